"""Hugging Face model folders (config.json, safetensors weights, tokenizer files) -> LoadedModel.

Every tensor is placed by a name table (HF name -> our parameter path + layout change), in the style of
vllm-project/tpu-inference's weight loading: the checkpoint must hold exactly the tensors the table expects, each with
the shape `checkpoint_param_shapes(config)` implies, so a checkpoint that does not match its config.json fails loudly.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from safetensors import SafetensorError, safe_open

from models.config import ModelConfig, UnsupportedModelError
from models.decoder import checkpoint_param_shapes
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.loading.checkpoint_files import CheckpointError, read_json_object
from vegas_jax.loading.placing import ParamPlacer
from vegas_jax.loading.tokenizer import Tokenizer


class _Layout(NamedTuple):
    """How a stored tensor maps onto our parameter of shape `target`."""

    stored_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]


def _linear(in_axes: int) -> _Layout:
    """A torch Linear weight `[out, in]`: ours is its transpose, our first `in_axes` axes being the input."""
    return _Layout(
        stored_shape=lambda t: (math.prod(t[in_axes:]), math.prod(t[:in_axes])),
        to_ours=lambda w, t: w.T.reshape(t),
    )


_AS_IS = _Layout(stored_shape=lambda t: t, to_ours=lambda w, t: w)
_FLAT = _Layout(stored_shape=lambda t: (math.prod(t),), to_ours=lambda w, t: w.reshape(t))  # biases: [N*H] -> [N, H]
_LINEAR = _linear(1)  # [out..., D] -> [D, out...]
_LINEAR_FROM_HEADS = _linear(2)  # o_proj: [D, N*H] -> [N, H, D]

# Llama, Mistral, Qwen2 and Qwen3 all use HF's Llama naming; they differ only in optional groups, which the config
# flags (attention_bias, qk_norm, tie_word_embeddings) select. "{i}" is the layer index.
_LAYER = {
    "model.layers.{i}.input_layernorm.weight": (("attn_norm", "scale"), _AS_IS),
    "model.layers.{i}.self_attn.q_proj.weight": (("q_proj",), _LINEAR),
    "model.layers.{i}.self_attn.k_proj.weight": (("k_proj",), _LINEAR),
    "model.layers.{i}.self_attn.v_proj.weight": (("v_proj",), _LINEAR),
    "model.layers.{i}.self_attn.o_proj.weight": (("o_proj",), _LINEAR_FROM_HEADS),
    "model.layers.{i}.post_attention_layernorm.weight": (("mlp_norm", "scale"), _AS_IS),
    "model.layers.{i}.mlp.gate_proj.weight": (("gate_proj",), _LINEAR),
    "model.layers.{i}.mlp.up_proj.weight": (("up_proj",), _LINEAR),
    "model.layers.{i}.mlp.down_proj.weight": (("down_proj",), _LINEAR),
}
_QKV_BIAS = {
    "model.layers.{i}.self_attn.q_proj.bias": (("q_bias",), _FLAT),
    "model.layers.{i}.self_attn.k_proj.bias": (("k_bias",), _FLAT),
    "model.layers.{i}.self_attn.v_proj.bias": (("v_bias",), _FLAT),
}
_QK_NORM = {
    "model.layers.{i}.self_attn.q_norm.weight": (("q_norm", "scale"), _AS_IS),
    "model.layers.{i}.self_attn.k_norm.weight": (("k_norm", "scale"), _AS_IS),
}
# fla-org NSA's branch gates: [H_q * 3, D], three (compressed, selected, window) per query head.
_NSA_GATES = {"model.layers.{i}.self_attn.g_proj.weight": (("branch_gate_proj",), _LINEAR)}
_GLOBAL = {
    "model.embed_tokens.weight": (("embed",), _AS_IS),
    "model.norm.weight": (("final_norm", "scale"), _AS_IS),
}
_UNTIED_HEAD = {"lm_head.weight": (("lm_head",), _LINEAR)}

# Stored by some exporters, never read: recomputed RoPE frequencies.
_HARMLESS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def name_map(config: ModelConfig) -> dict[str, tuple[tuple, _Layout]]:
    """Every HF tensor name a checkpoint of `config` must hold -> (path into our params, layout)."""
    layer = dict(_LAYER)
    if config.attention_bias:
        layer |= _QKV_BIAS
    if config.qk_norm:
        layer |= _QK_NORM
    if config.attention == "nsa":
        layer |= _NSA_GATES
    table = dict(_GLOBAL)
    if not config.tie_word_embeddings:
        table |= _UNTIED_HEAD
    for i in range(config.num_layers):
        table |= {name.format(i=i): (("layers", i, *path), layout) for name, (path, layout) in layer.items()}
    return table


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    hf = read_json_object(path)
    try:
        return ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e}") from e


def _tensor_files(folder: Path) -> tuple[dict[str, Path], Path]:
    """Tensor name -> safetensors file holding it, and the file (index or single checkpoint) that says so."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from e
        return {name: folder / file for name, file in weight_map.items()}, index
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single), single


def _open(path: Path):
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e


def _some(names: list[str]) -> str:
    return repr(names[0]) + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_hf(folder: str | Path, dtype=jnp.bfloat16, mesh=None) -> LoadedModel:
    folder = Path(folder)
    config = read_config(folder)
    table = name_map(config)
    stored, listing = _tensor_files(folder)

    missing = [name for name in table if name not in stored]
    if missing:
        raise CheckpointError(f"{listing}: missing tensor {_some(missing)}")
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding, as HF ties it on load).
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in stored if n not in table and n not in ignorable and not _HARMLESS.fullmatch(n))
    if unexpected:
        raise CheckpointError(
            f"{listing}: unexpected tensor {_some(unexpected)} "
            f"for a {config.architecture} model as config.json describes it"
        )

    shapes = checkpoint_param_shapes(config)
    placer = ParamPlacer(config, dtype, mesh)
    by_file: dict[Path, list[str]] = {}
    for name in table:
        by_file.setdefault(stored[name], []).append(name)
    # A layer is fused and placed as soon as all its tensors are read: the host holds a few layers' worth at most
    # (a layer's tensors may sit in two files).
    layer_size = {}
    for path, _ in table.values():
        if path[0] == "layers":
            layer_size[path[1]] = layer_size.get(path[1], 0) + 1
    pending: dict[int, dict] = {}
    params: dict = {"layers": {}}
    # disable=None: a bar only on a terminal, never in logs or tests.
    bar = tqdm(total=len(table), desc="loading", unit="tensor", leave=False, disable=None)
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{file}: missing tensor {name!r} (listed there by {listing.name})")
                path, layout = table[name]
                target = _get(shapes, path)
                try:
                    w = f.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"{file}: unreadable tensor {name!r} ({e})") from e
                if w.shape != layout.stored_shape(target):
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {list(w.shape)}, "
                        f"config.json implies {list(layout.stored_shape(target))}"
                    )
                host = layout.to_ours(w, target)
                if path[0] == "layers":
                    layer = pending.setdefault(path[1], {})
                    _set(layer, path[2:], host)
                    layer_size[path[1]] -= 1
                    if not layer_size[path[1]]:
                        params["layers"][path[1]] = placer.layer(pending.pop(path[1]))
                else:
                    _set(params, path, placer.tensor(path[-1], host))
                bar.update()
    bar.close()
    params["layers"] = placer.stack(params["layers"])
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=Tokenizer.from_hf_folder(folder),
        source=str(folder),
        format="hf",
        mesh=mesh,
    )
