"""Attention families: the static value that says, for a model's attention kind (models.config), what its cache
is and which attention its full passes (prefill, plain decoding, verification) run. Dense is one family, NSA
(the "nsa" and "nsa-view" kinds) the other; drafts and selection policies exist for the dense family only."""

from __future__ import annotations

import dataclasses

from models.config import NSA_VIEW_LAYOUT, ModelConfig, NSALayout
from models.kv_cache import KVCache
from models.nsa_cache import NSACache
from vegas_jax.attention.nsa import NSAAttention
from vegas_jax.attention.verify import ScoreRequest, VerifyAttention
from vegas_jax.inputs import InputError
from vegas_jax.sharding import Placement


@dataclasses.dataclass(frozen=True)
class DenseFamily:
    def create_cache(self, config: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
        return KVCache.create(config, batch, capacity, dtype)

    def full_attention(self, config: ModelConfig, placement: Placement, request: ScoreRequest | None = None,
                       active=None) -> VerifyAttention:
        return VerifyAttention(request, config.num_layers, placement, active)


@dataclasses.dataclass(frozen=True)
class NSAFamily:
    def create_cache(self, config: ModelConfig, batch: int, capacity: int, dtype) -> NSACache:
        return NSACache.create(config, batch, capacity, dtype)

    def full_attention(self, config: ModelConfig, placement: Placement, request: ScoreRequest | None = None,
                       active=None) -> NSAAttention:
        if request is not None:
            raise ValueError("NSA models verify without selection scores (no dense draft policy serves them)")
        return NSAAttention(config.nsa, config.attention, placement)


def family_of(config: ModelConfig) -> DenseFamily | NSAFamily:
    return DenseFamily() if config.attention == "dense" else NSAFamily()


ATTENTION_CHOICES = ("dense", "nsa-view")  # what --attention may ask of a model (an NSA checkpoint runs as NSA)


def with_attention(config: ModelConfig, attention: str | None, layout: NSALayout = NSA_VIEW_LAYOUT) -> ModelConfig:
    """`config` attending as `attention` asks (None: as it is): "nsa-view" turns a dense model into its
    training-free NSA view with `layout`; "dense" keeps a dense model. InputError naming attention otherwise."""
    if attention is None or attention == config.attention:
        return config
    if attention not in ATTENTION_CHOICES:
        raise InputError("{attention} must be one of {}, got {!r}", ", ".join(ATTENTION_CHOICES), attention)
    if config.attention != "dense":
        raise InputError("{attention} {}: the model is an {} checkpoint and runs only as one", attention,
                         config.attention)
    return dataclasses.replace(config, attention="nsa-view", nsa=layout)
