"""GGUF loading: the embedded SmolLM2 against Hugging Face transformers' own GGUF loading (fixtures from
tests/fixtures/make_hf_fixtures_smollm2.py), block formats against numpy decoders written from the format, and the
layout/metadata mapping on small synthetic files."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from models import draft_weights, quantized
from models.config import ModelConfig, RopeScaling, UnsupportedModelError, rope_inverse_frequencies
from models.decoder import forward, per_layer
from models.kv_cache import KVCache
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.loading import gguf_blocks
from vegas_jax.loading import CheckpointError
from vegas_jax.loading.gguf import SUPPORTED_TYPES, dequantize, embedded_smollm2_path, load_gguf, open_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "smollm2"
LOGIT_CASES = json.loads((FIXTURES / "logits.json").read_text())
GREEDY_CASES = json.loads((FIXTURES / "greedy.json").read_text())
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2():
    # float32 weights and cache: the reference ran in float32, so only summation order separates the two.
    return load_gguf(embedded_smollm2_path(), dtype=jnp.float32)


# ---------------------------------------------------------------------------------------- the embedded SmolLM2


def test_config_matches_transformers(smollm2):
    hf = json.loads((FIXTURES / "config.json").read_text())
    assert smollm2.config == ModelConfig.from_hf(hf)
    assert smollm2.format == "gguf" and smollm2.source == str(embedded_smollm2_path())


@pytest.mark.parametrize("case", LOGIT_CASES, ids=[c["prompt"][:20] for c in LOGIT_CASES])
def test_logits_match_transformers(smollm2, case):
    assert smollm2.tokenizer.encode(case["prompt"]) == case["ids"]
    cache = KVCache.create(smollm2.config, 1, CACHE_ROWS, jnp.float32)
    logits, _, _ = _logits(smollm2, case["ids"], list(range(len(case["ids"]))), cache)
    logits = np.asarray(logits[0])
    width = len(case["slice"][0])
    np.testing.assert_allclose(logits[:, :width], np.array(case["slice"]), atol=2e-3, rtol=0)
    np.testing.assert_allclose(logits[-1, case["top_ids"]], case["top_values"], atol=2e-3, rtol=0)
    assert list(np.argsort(-logits[-1])[:5]) == case["top_ids"][:5]


def test_score_matches_transformers(smollm2):
    """Engine.score on SmolLM2 against the fixture's logits, which hold the top 20 of the last position and the first
    64 ids at every position, not a whole row: the differences of scored log-probabilities equal the differences of
    those logits (the log-softmax's normaliser cancels), only the top token is greedy, and their probabilities sum to
    at most 1. One batch of 12 pairs."""
    from vegas_jax.runtime.engine import Engine

    pairs = [(case["ids"], [t]) for case in LOGIT_CASES for t in case["top_ids"][:3]]
    head = LOGIT_CASES[0]["ids"][:3]
    pairs += [(head, [t]) for t in (10, 20, 30)]
    scored = Engine(smollm2).score([p for p, _ in pairs], [c for _, c in pairs], batch_size=len(pairs))
    for n, case in enumerate(LOGIT_CASES):
        got = np.array([s.logprobs[0] for s in scored[3 * n : 3 * n + 3]])
        np.testing.assert_allclose(got - got[0], np.array(case["top_values"][:3]) - case["top_values"][0], atol=2e-3)
        assert [s.greedy for s in scored[3 * n : 3 * n + 3]] == [True, False, False]
        assert np.exp(got).sum() <= 1 and got[0] < 0
    slice_ = np.array(LOGIT_CASES[0]["slice"][2])
    got = np.array([s.logprobs[0] for s in scored[9:]])
    np.testing.assert_allclose(got - got[0], slice_[[10, 20, 30]] - slice_[10], atol=2e-3)


def test_stop_strings_read_smollm2_text_as_its_tokens_bytes(smollm2):
    """Stop strings are matched on the bytes of the emitted tokens: for SmolLM2's vocabulary (checked token by token
    inside token_bytes) the decoded text of any sequence is the UTF-8 decoding of its tokens' bytes joined."""
    from vegas_jax.decode import stops

    pieces = stops.token_bytes(smollm2.tokenizer)
    assert len(pieces) == smollm2.config.vocab_size and pieces[smollm2.tokenizer.eos_ids[0]] == b""
    rng = np.random.default_rng(3)
    for _ in range(200):
        ids = rng.integers(0, len(pieces), rng.integers(1, 30)).tolist()
        assert smollm2.tokenizer.decode(ids) == b"".join(pieces[i] for i in ids).decode("utf-8", "replace")


# One compiled step per input shape, shared by every test (the model is the same).
_forward = jax.jit(forward, static_argnames="config")
CACHE_ROWS = 128  # fixed, so the one-token step compiles once for all prompts


def _logits(model, tokens: list[int], positions: list[int], cache: KVCache):
    t = jnp.asarray([tokens], jnp.int32)
    p = jnp.asarray([positions], jnp.int32)
    return _forward(model.params, t, p, cache, DenseAttention(), config=model.config)


def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Prefill the prompt, then feed back one argmax token at a time (no EOS stop, as the fixture)."""
    assert len(prompt) + new_tokens <= CACHE_ROWS
    cache = KVCache.create(model.config, 1, CACHE_ROWS, jnp.float32)
    logits, cache, _ = _logits(model, prompt, list(range(len(prompt))), cache)
    out = [int(jnp.argmax(logits[0, -1]))]
    while len(out) < new_tokens:
        logits, cache, _ = _logits(model, out[-1:], [len(prompt) + len(out) - 1], cache)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


@pytest.mark.parametrize("case", GREEDY_CASES, ids=[c["kind"] for c in GREEDY_CASES])
def test_greedy_continuation_matches_transformers(smollm2, case):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_chat(case["prompt"]) if case["kind"] == "chat" else tokenizer.encode(case["prompt"])
    assert prompt == case["prompt_ids"]
    margin = f"transformers' smallest top-1/top-2 logit margin on this path: {case['min_margin']:.4f}"
    assert _greedy(smollm2, prompt, len(case["new_ids"])) == case["new_ids"], margin


# ---------------------------------------------------------------------------------------- errors


def test_the_fast_reader_reads_what_gguf_reads():
    """open_gguf's reader (gguf's, over a plain view of the map) against gguf's own on the real file: every field's
    value and every tensor's name, type, shape and bytes."""
    path = embedded_smollm2_path()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(a.data, b.data), a.name


def test_not_a_gguf_file_names_it(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"this is not a GGUF file\n" * 64)
    with pytest.raises(CheckpointError, match=str(path)):
        load_gguf(path)


def test_truncated_gguf_names_it(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(embedded_smollm2_path(), "rb") as f:
        path.write_bytes(f.read(3_000_000))  # metadata complete, tensor data cut short
    with pytest.raises(CheckpointError, match=str(path)):
        load_gguf(path)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="nothing-here.gguf"):
        load_gguf(tmp_path / "nothing-here.gguf")


def test_other_architecture_is_refused(tmp_path):
    path = _write_gguf(tmp_path / "qwen.gguf", arch="qwen2", tensors={})
    with pytest.raises(UnsupportedModelError) as error:
        load_gguf(path)
    assert "'qwen2'" in str(error.value) and str(path) in str(error.value)


# ---------------------------------------------------------------------------------------- block formats
# Each builder draws the format's fields (scales, offsets, integer codes) at random, packs them into bytes as
# ggml lays them out, and returns the bytes with the values those fields mean.


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _q8_0(rng, rows, cols):
    d = rng.uniform(-0.1, 0.1, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(-128, 128, (rows, cols // 32, 32), dtype=np.int8)
    raw = np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=-1)  # {f16 d; i8 qs[32]}
    return raw.reshape(rows, -1), (d.astype(np.float32)[..., None] * q).reshape(rows, cols)


def _nibbles(rng, rows, cols):
    """Codes 0..15 for 32 elements per block, and the 16 bytes holding them: element j in the low nibble of
    byte j, element j + 16 in its high nibble."""
    lo = rng.integers(0, 16, (rows, cols // 32, 16), dtype=np.uint8)
    hi = rng.integers(0, 16, (rows, cols // 32, 16), dtype=np.uint8)
    return np.concatenate([lo, hi], axis=-1).astype(np.float32), lo | (hi << 4)


def _q4_0(rng, rows, cols):
    d = rng.uniform(-0.1, 0.1, (rows, cols // 32)).astype(np.float16)
    codes, packed = _nibbles(rng, rows, cols)
    raw = np.concatenate([_f16_bytes(d), packed], axis=-1)  # {f16 d; u8 qs[16]}
    return raw.reshape(rows, -1), (d.astype(np.float32)[..., None] * (codes - 8)).reshape(rows, cols)


def _q4_1(rng, rows, cols):
    d = rng.uniform(0.0, 0.1, (rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-1.0, 0.0, (rows, cols // 32)).astype(np.float16)
    codes, packed = _nibbles(rng, rows, cols)
    raw = np.concatenate([_f16_bytes(d), _f16_bytes(m), packed], axis=-1)  # {f16 d; f16 m; u8 qs[16]}
    values = d.astype(np.float32)[..., None] * codes + m.astype(np.float32)[..., None]
    return raw.reshape(rows, -1), values.reshape(rows, cols)


def _bf16(rng, rows, cols):
    bits = rng.integers(0, 2**16, (rows, cols), dtype=np.uint32)
    bits = bits[(bits & 0x7F80) != 0x7F80].reshape(-1)  # no inf/nan patterns
    bits = np.resize(bits, (rows, cols))
    values = (bits << 16).view(np.float32)  # bfloat16 is the top half of a float32
    return bits.astype(np.uint16).view(np.uint8).reshape(rows, cols * 2), values


def _f16(rng, rows, cols):
    values = rng.standard_normal((rows, cols)).astype(np.float16)
    return values, values.astype(np.float32)


def _f32(rng, rows, cols):
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    return values, values


BLOCK_BUILDERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.BF16: _bf16, Q.F16: _f16, Q.F32: _f32}


def test_every_supported_type_has_a_reference():
    assert set(BLOCK_BUILDERS) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=[t.name for t in SUPPORTED_TYPES])
def test_dequantize_matches_block_format(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    raw, expected = BLOCK_BUILDERS[qtype](rng, 3, 96)
    raw_dtype = qtype if raw.dtype == np.uint8 else None
    path = _write_gguf(tmp_path / "blocks.gguf", arch="llama", tensors={"w": (raw, raw_dtype)})
    (tensor,) = gguf.GGUFReader(path).tensors
    got = dequantize(tensor, path)
    assert got.dtype == np.float32 and got.shape == (3, 96)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", list(gguf_blocks.BLOCK_TYPES), ids=[t.name for t in gguf_blocks.BLOCK_TYPES])
def test_blocks_read_as_they_are_into_draft_weights(qtype):
    """A tensor's blocks as a draft weight (no float detour): its values, scales and offsets mean the builders'
    values, the input axis first."""
    rng = np.random.default_rng(int(qtype))
    raw, expected = BLOCK_BUILDERS[qtype](rng, 3, 96)  # [3 output channels, 96 input positions]
    precision = gguf_blocks.precision_of(qtype)
    weight = gguf_blocks.as_weight(*gguf_blocks.read_blocks(raw, qtype, rows=3), (3,))
    assert weight.input_size == 96 and weight.scale.shape == (3, 3) and weight.group_size == 32
    assert weight.values.dtype == (np.uint8 if precision == "int4" else np.int8)  # int4: the file's nibble bytes
    assert (weight.offset is not None) == (qtype != Q.Q8_0)  # Q4_0's offset: -8 d
    placed = jax.tree.map(jnp.asarray, weight)
    np.testing.assert_allclose(np.asarray(quantized.dequantize(placed)), expected.T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype,precision", [(Q.Q4_1, "int4"), (Q.Q4_0, "int4"), (Q.Q8_0, "int8"), (Q.Q4_1, "int8")])
def test_draft_weights_from_the_files_blocks(tmp_path, qtype, precision):
    """A llama file stored in blocks, loaded with a draft: where the blocks have a draft weight's precision (the
    LM head's is int8 whatever the draft's) that weight (q / k rows un-permuted, q / k / v and gate / up fused, o's
    heads flattened) is those blocks, so it means exactly the weights the model loaded; otherwise it is quantized
    from the loaded weights, within half a step of them."""
    path, _ = _tiny_llama(tmp_path, quantize=qtype)
    m = load_gguf(path, dtype=jnp.float32, draft=precision)
    tree = m.drafts[precision]
    layers_native = gguf_blocks.precision_of(qtype) == precision
    head_native = gguf_blocks.precision_of(qtype) == "int8"
    count = 8 * layers_native + head_native
    assert m.draft_sources[precision].startswith(f"{count} of 9 weights" if count else "quantized from")
    layers, full_layers = per_layer(tree)["layers"], per_layer(m.params)["layers"]
    pairs = [(tree["lm_head"], m.params["lm_head"], head_native)] + [
        (layers[i][name], full_layers[i][name], layers_native)
        for i in range(TINY["layers"]) for name in draft_weights.LAYER_WEIGHTS
    ]
    assert tree["lm_head"].bits == 8
    for weight, full, native in pairs:
        back = np.asarray(quantized.dequantize(weight)).reshape(full.shape)
        if native:
            assert weight.group_size == 32
            np.testing.assert_allclose(back, np.asarray(full), rtol=1e-6, atol=1e-6)
        else:  # int8 per channel, or int4 in groups, of the dequantized weights: within half a step
            assert weight.group_size == (32 if weight.bits == 4 else weight.input_size)
            step = np.repeat(np.asarray(weight.scale), weight.group_size, axis=0).reshape(full.shape)
            assert np.all(np.abs(back - np.asarray(full)) <= step / 2 * (1 + 1e-5) + 1e-6)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, (2, 22), dtype=np.uint8)  # one Q5_0 block per row
    path = _write_gguf(tmp_path / "q5.gguf", arch="llama", tensors={"blk.0.ffn_up.weight": (raw, Q.Q5_0)})
    (tensor,) = gguf.GGUFReader(path).tensors
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        dequantize(tensor, path)


# ---------------------------------------------------------------------------------------- synthetic llama files

TINY = dict(hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=96, layers=2, theta=500000.0)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows (for its interleaved RoPE)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _llama_cpp_rope_factors(theta, head_dim, factor, low, high, old_context):
    """convert_hf_to_gguf.py's Llama 3 `rope_freqs` divisors, transcribed from its loop."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _tiny_llama(tmp_path, *, rope_freqs=None, extra=None, quantize=None):
    """A two-layer untied llama GGUF from Hugging Face-layout float32 weights, its matrices stored in the block
    type `quantize` if given (by the gguf library's own quantizer); returns (path, hf_weights)."""
    t = TINY
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = ["<s>", "</s>", *sorted(alphabet), "ab"]
    vocab, d, f = len(tokens), t["hidden"], t["ffn"]
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    hf = {"embed": w(vocab, d), "norm": w(d), "lm_head": w(vocab, d), "layers": []}
    tensors = {"token_embd.weight": hf["embed"], "output_norm.weight": hf["norm"], "output.weight": hf["lm_head"]}
    for i in range(t["layers"]):
        layer = {
            "q": w(t["heads"] * t["head_dim"], d), "k": w(t["kv_heads"] * t["head_dim"], d),
            "v": w(t["kv_heads"] * t["head_dim"], d), "o": w(d, t["heads"] * t["head_dim"]),
            "gate": w(f, d), "up": w(f, d), "down": w(d, f), "attn_norm": w(d), "mlp_norm": w(d),
        }  # fmt: skip
        hf["layers"].append(layer)
        p = f"blk.{i}."
        tensors |= {
            p + "attn_q.weight": _llama_cpp_permute(layer["q"], t["heads"]),
            p + "attn_k.weight": _llama_cpp_permute(layer["k"], t["kv_heads"]),
            p + "attn_v.weight": layer["v"], p + "attn_output.weight": layer["o"],
            p + "ffn_gate.weight": layer["gate"], p + "ffn_up.weight": layer["up"],
            p + "ffn_down.weight": layer["down"],
            p + "attn_norm.weight": layer["attn_norm"], p + "ffn_norm.weight": layer["mlp_norm"],
        }  # fmt: skip
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    tensors |= extra or {}

    def metadata(writer: gguf.GGUFWriter):
        writer.add_block_count(t["layers"])
        writer.add_context_length(4096)
        writer.add_embedding_length(d)
        writer.add_feed_forward_length(f)
        writer.add_head_count(t["heads"])
        writer.add_head_count_kv(t["kv_heads"])
        writer.add_rope_dimension_count(t["head_dim"])
        writer.add_rope_freq_base(t["theta"])
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3] + [1] * (vocab - 2))
        writer.add_token_merges(["a b"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)

    def stored(array):
        if quantize is None or array.ndim != 2:
            return array, None
        return gguf.quants.quantize(array, quantize), quantize

    path = _write_gguf(tmp_path / "tiny.gguf", arch="llama", tensors={k: stored(v) for k, v in tensors.items()},
                       metadata=metadata)  # fmt: skip
    return path, hf


def test_synthetic_llama_layout(tmp_path):
    path, hf = _tiny_llama(tmp_path)
    m = load_gguf(path, dtype=jnp.float32)
    t, c = TINY, m.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (t["layers"], t["heads"], t["kv_heads"], 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (len(hf["embed"]), t["theta"], 4096)
    assert not c.tie_word_embeddings and c.rope_scaling is None
    p = m.params
    np.testing.assert_array_equal(p["embed"], hf["embed"])
    np.testing.assert_array_equal(p["lm_head"], hf["lm_head"].T)
    np.testing.assert_array_equal(p["final_norm"]["scale"], hf["norm"])
    for i, layer in enumerate(hf["layers"]):
        got = per_layer(p)["layers"][i]
        # Our projections are HF's nn.Linear weights [out, in] transposed, with the heads split out; q, k and v
        # heads sit side by side in qkv_proj, gate and up in gate_up_proj.
        q, k, v = np.split(np.asarray(got["qkv_proj"]), [t["heads"], t["heads"] + t["kv_heads"]], axis=1)
        np.testing.assert_array_equal(q, layer["q"].T.reshape(t["hidden"], t["heads"], 64))
        np.testing.assert_array_equal(k, layer["k"].T.reshape(t["hidden"], t["kv_heads"], 64))
        np.testing.assert_array_equal(v, layer["v"].T.reshape(t["hidden"], t["kv_heads"], 64))
        np.testing.assert_array_equal(got["o_proj"], layer["o"].T.reshape(t["heads"], 64, t["hidden"]))
        np.testing.assert_array_equal(got["gate_up_proj"][:, 0], layer["gate"].T)
        np.testing.assert_array_equal(got["gate_up_proj"][:, 1], layer["up"].T)
        np.testing.assert_array_equal(got["down_proj"], layer["down"].T)
        np.testing.assert_array_equal(got["attn_norm"]["scale"], layer["attn_norm"])
        np.testing.assert_array_equal(got["mlp_norm"]["scale"], layer["mlp_norm"])
    assert m.tokenizer.bos_id == 0 and m.tokenizer.eos_ids == (1,)
    assert m.tokenizer.encode("ab") == [len(hf["embed"]) - 1]


def test_default_dtype_is_bfloat16(tmp_path):
    path, _ = _tiny_llama(tmp_path)
    assert {x.dtype for x in jax.tree.leaves(load_gguf(path).params)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, factor):
    stored = _llama_cpp_rope_factors(TINY["theta"], TINY["head_dim"], factor, 1.0, 4.0, 8192)
    path, _ = _tiny_llama(tmp_path, rope_freqs=stored)
    c = load_gguf(path, dtype=jnp.float32).config
    expected = RopeScaling(factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert c.rope_scaling == expected  # every Llama 3.x release uses low_freq_factor 1, so these come back exactly
    # and the scaled frequencies are llama.cpp's: the unscaled ones divided by the stored divisors
    unscaled = rope_inverse_frequencies(dataclasses.replace(c, rope_scaling=None))
    np.testing.assert_allclose(rope_inverse_frequencies(c), unscaled / stored, rtol=1e-6)


def test_unknown_rope_freqs_are_refused(tmp_path):
    stored = np.random.default_rng(1).uniform(1.0, 4.0, TINY["head_dim"] // 2).astype(np.float32)
    path, _ = _tiny_llama(tmp_path, rope_freqs=stored)
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_gguf(path)


def test_unknown_tensor_is_refused(tmp_path):
    path, _ = _tiny_llama(tmp_path, extra={"blk.0.attn_q.bias": np.zeros(128, np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.bias"):
        load_gguf(path)


def _write_gguf(path: Path, *, arch: str, tensors: dict, metadata=None) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    if metadata is not None:
        metadata(writer)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
