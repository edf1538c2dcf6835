"""Hugging Face folders load into the same model HF transformers runs: logits against transformers' own (fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.decoder import forward
from models.kv_cache import KVCache
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.loading import load_model
from vegas_jax.loading.hf import load_hf

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["tiny-llama", "tiny-qwen3", "tiny-qwen2"]
# One compilation per model beats op-by-op dispatch by several times, even for two layers.
jitted_forward = jax.jit(forward, static_argnames=("config",))


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / "reference.json").read_text())


def logits_for(loaded, sequences: list[list[int]]) -> list[np.ndarray]:
    """One batched forward pass; shorter sequences are padded at the end, which causality keeps out of their rows."""
    length = max(map(len, sequences))
    tokens = jnp.array([ids + [0] * (length - len(ids)) for ids in sequences], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    cache = KVCache.create(loaded.config, len(sequences), length, loaded.params["embed"].dtype)
    logits, _, _ = jitted_forward(loaded.params, tokens, positions, cache, DenseAttention(), config=loaded.config)
    return [np.asarray(row[: len(ids)]) for row, ids in zip(logits, sequences)]


def test_fixtures_cover_the_features_they_exist_for():
    llama = load_hf(FIXTURES / "tiny-llama", jnp.float32).config
    assert llama.architecture == "llama" and not llama.tie_word_embeddings
    assert llama.num_kv_heads < llama.num_heads and llama.rope_scaling is not None
    assert (FIXTURES / "tiny-llama" / "model.safetensors.index.json").is_file()
    assert len(list((FIXTURES / "tiny-llama").glob("*.safetensors"))) >= 2
    qwen3 = load_hf(FIXTURES / "tiny-qwen3", jnp.float32).config
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim != qwen3.hidden_size // qwen3.num_heads
    qwen2 = load_hf(FIXTURES / "tiny-qwen2", jnp.float32).config
    assert qwen2.architecture == "qwen2" and qwen2.attention_bias


@pytest.mark.parametrize("name", MODELS)
def test_float32_logits_match_transformers(name):
    ref = reference(name)
    loaded = load_model(str(FIXTURES / name), jnp.float32)
    assert loaded.format == "hf"
    ours = logits_for(loaded, [s["input_ids"] for s in ref["sequences"]])
    for got, seq in zip(ours, ref["sequences"]):
        want = np.array(seq["logits"])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_load_rounds_the_float32_weights(name):
    f32 = load_hf(FIXTURES / name, jnp.float32).params
    bf16 = load_hf(FIXTURES / name, jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16.params), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))
    # bf16 arithmetic drifts (a few percent here) but stays the same model; a layout error moves logits by ~100%.
    seq = reference(name)["sequences"][0]
    (got,) = logits_for(bf16, [seq["input_ids"]])
    want = np.array(seq["logits"])
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_matches_transformers(name):
    ref = reference(name)
    tok = load_hf(FIXTURES / name, jnp.float32).tokenizer
    for seq in ref["sequences"]:
        assert tok.encode(seq["text"]) == seq["input_ids"]
        assert tok.decode(seq["input_ids"]) == seq["text"]
    assert tok.encode_chat(ref["chat"]["messages"]) == ref["chat"]["input_ids"]
    generation_config = json.loads((FIXTURES / name / "generation_config.json").read_text())
    assert sorted(tok.eos_ids) == sorted(generation_config["eos_token_id"])


def test_bfloat16_checkpoint_loads(tmp_path):
    """numpy has no bfloat16 of its own; bf16-stored checkpoints (most hub models) must still load, in any dtype."""
    folder = shutil.copytree(FIXTURES / "tiny-qwen3", tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, folder / "model.safetensors")
    want = load_hf(FIXTURES / "tiny-qwen3", jnp.float32).params
    got = load_hf(folder, jnp.float32).params
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)))


def test_tied_checkpoint_may_store_lm_head_and_rotary_buffers(tmp_path):
    """Some exporters store the tied head and RoPE inv_freq buffers: redundant, they must not change the model."""
    folder = shutil.copytree(FIXTURES / "tiny-qwen2", tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, folder / "model.safetensors")
    for a, b in zip(
        jax.tree.leaves(load_hf(folder, jnp.float32).params),
        jax.tree.leaves(load_hf(FIXTURES / "tiny-qwen2", jnp.float32).params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
