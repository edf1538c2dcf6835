"""An engine over random weights of SmolLM2-135M's shapes: for timing only (acceptance means nothing on random
weights, so no τ from it is ever reported)."""

from __future__ import annotations

import jax.numpy as jnp

from models.config import ModelConfig
from models.decoder import init_params
from vegas_jax.engine import Engine
from vegas_jax.loading.bundle import LoadedModel

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=True,
)


class NoTextTokenizer:
    """Random weights produce no text worth decoding; the loop needs only the stop ids (none here)."""

    eos_ids = ()
    chat_template = None

    def decode(self, ids):
        return ""


def random_smollm2_engine(dtype=jnp.bfloat16) -> Engine:
    params = init_params(SMOLLM2_135M, dtype)
    return Engine(LoadedModel(SMOLLM2_135M, params, NoTextTokenizer(), "random", "random"))
