"""Engines over random weights of real models' shapes (SmolLM2-135M, Llama-3.1-8B, Qwen3-8B): for timing only
(acceptance means nothing on random weights, so no τ from them is ever reported)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import draft_head
from models.config import ModelConfig, NSALayout, RopeScaling
from models.decoder import init_params
from vegas_jax.runtime.engine import Engine
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.loading.draft_head_checkpoint import span
from vegas_jax.train_draft_head import Settings

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# meta-llama/Llama-3.1-8B-Instruct's config.json
LLAMA31_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
    tie_word_embeddings=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
)
# Qwen/Qwen3-8B's config.json, but for its context: 40,960 natively, 131,072 with YaRN scaling (which the engine does
# not implement; rotary frequencies do not change what a step costs, so timing takes the longer context as is).
QWEN3_8B = ModelConfig(
    architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
    tie_word_embeddings=False, qk_norm=True,
)
# The scripts' --smoke runs on a CPU: a tiny dense model (seen as NSA through TINY_NSA_LAYOUT where they need one).
TINY = ModelConfig(
    architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=1024,
    tie_word_embeddings=True,
)
TINY_NSA_LAYOUT = NSALayout(16, 16, 16, 2, 16, forced_initial=1, forced_local=1)
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.1-8b": LLAMA31_8B, "qwen3-8b": QWEN3_8B, "tiny": TINY}


class NoTextTokenizer:
    """Random weights produce no text worth decoding; the loop needs only the stop ids (none here)."""

    eos_ids = ()
    chat_template = None

    def decode(self, ids):
        return ""


def random_model(config: ModelConfig, dtype=jnp.bfloat16) -> LoadedModel:
    return LoadedModel(config, init_params(config, dtype), NoTextTokenizer(), "random", "random")


def random_engine(config: ModelConfig, dtype=jnp.bfloat16) -> Engine:
    return Engine(random_model(config, dtype))


def random_smollm2_engine(dtype=jnp.bfloat16) -> Engine:
    return random_engine(SMOLLM2_135M, dtype)


def with_random_head(engine: Engine, vocabulary: int = 0) -> Engine:
    """The engine drafting with an untrained draft head of its shapes (in the model's dtype), attending over the
    training defaults' window, with a draft vocabulary of the first `vocabulary` token ids (which ones changes no
    cost; 0, or at least the model's vocabulary: all of it): its passes cost a trained head's; its drafts are
    rejected."""
    defaults = Settings()
    engine.use_draft_head(draft_head.init_params(engine.config),
                          window=span(defaults.context_tokens, defaults.prompt_tokens, defaults.new_tokens),
                          vocabulary=np.arange(vocabulary) if 0 < vocabulary < engine.config.vocab_size else 0)
    return engine


def cache_as_allocated(cache):
    """Engine.start's fill_cache where no prefill is wanted: the zeroed cache as allocated stands for a prefilled
    one (timing at shapes too large to prefill often; compiling a loop ahead of its run, which prefills)."""
    return cache


def random_cache_rows(cache):
    """Engine.start's fill_cache for timing: every float array of the cache standard normal (what prefill would
    leave, for the cost of reading it), index arrays kept. The generator is XLA's RngBitGenerator: threefry over an
    8B model's 32K-row cache took minutes to compile on the H200. Each array is written over in place: jit drops
    an argument its result does not read, and with it the donation, so the filled cache used to be a second copy
    beside the zeroed one the engine still held (81 GiB peak for 48 GiB of data at Llama-3.1-8B shapes, batch
    8 x 32K, on the H200), and batch 16 x 32K and batch 4 x 128K ran out of memory."""
    leaves, tree = jax.tree.flatten(cache)
    keys = jax.random.split(jax.random.key(0, impl="unsafe_rbg"), len(leaves))
    return jax.tree.unflatten(tree, [_normal_in_place(k, x) if jnp.issubdtype(x.dtype, jnp.floating) else x
                                     for k, x in zip(keys, leaves)])


def _normal_in_place(key, x):
    return _normal_filler(x.sharding)(key, x)


@functools.lru_cache(maxsize=None)
def _normal_filler(sharding):
    """x's shape of standard normals, written over x (donated, and kept although unread, so that the donation
    holds) and laid out as x was: one program per layout, compiled once per shape."""
    return jax.jit(lambda key, x: jax.random.normal(key, x.shape, x.dtype), donate_argnums=1, keep_unused=True,
                   out_shardings=sharding)
