"""What a decoder-only transformer is, as a hashable value (usable as a static jit argument)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# How a layer attends: dense causal attention; Native Sparse Attention (compressed, selected and window branches
# mixed by sigmoid gates, arXiv 2502.11089); or the training-free NSA view of a dense model (selected blocks and
# the window in one softmax, no compressed branch, no gates).
ATTENTION_KINDS = ("dense", "nsa", "nsa-view")
POOLINGS = ("mean",)

# HF `model_type` / `architectures[0]` -> our architecture name.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


class UnsupportedModelError(ValueError):
    """A checkpoint describes a model this package cannot run exactly."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.x frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class NSALayout:
    """Where an NSA query looks (all lengths in tokens). Compressed block i covers keys [i*stride, i*stride +
    compress_block) and is visible once complete; selection block j covers [j*select_block, (j+1)*select_block).
    A query's top_n selection blocks (shared by a KV group's query heads) count the forced ones: the first
    forced_initial blocks and the forced_local blocks ending at the query's own block. The window is the last
    `window` keys, the query's own included."""

    compress_block: int  # l
    compress_stride: int  # d
    select_block: int  # l'
    top_n: int  # n
    window: int  # w
    forced_initial: int
    forced_local: int
    pooling: str = "mean"  # how a compressed key/value summarises its block's rotated keys/values

    def __post_init__(self):
        d = self.compress_stride
        if min(self.compress_block, d, self.select_block, self.top_n) < 1 or self.window < 0:
            raise UnsupportedModelError(f"NSA layout {self}: block sizes and top_n must be positive, window >= 0")
        if self.compress_block % d or self.select_block % d:
            raise UnsupportedModelError(
                f"NSA layout: compress_block {self.compress_block} and select_block {self.select_block} must be "
                f"multiples of compress_stride {d}")
        if self.forced_local < 1 or self.forced_initial < 0 or self.forced_initial + self.forced_local > self.top_n:
            raise UnsupportedModelError(
                f"NSA layout: forced blocks ({self.forced_initial} initial + {self.forced_local} local, the query's "
                f"own block among them) must fit in top_n {self.top_n}")
        if self.pooling not in POOLINGS:
            raise UnsupportedModelError(f"NSA layout: pooling {self.pooling!r} (only {', '.join(POOLINGS)})")


# zen-E/NSA-1B (fla-org's parallel_nsa): l = d = l' = 16, 16 blocks, window 128, only the query's block forced.
NSA_1B_LAYOUT = NSALayout(16, 16, 16, 16, 128, forced_initial=0, forced_local=1)
# The NSA paper's: l = 32, d = 16, l' = 64, 16 blocks counting 1 initial and 2 local, window 512 (its learned
# compression MLP replaced by mean pooling, which no checkpoint here can train).
NSA_PAPER_LAYOUT = NSALayout(32, 16, 64, 16, 512, forced_initial=1, forced_local=2)
# The training-free view of a dense model: NSA-1B's blocks with the attention sink (block 0) forced as well.
NSA_VIEW_LAYOUT = NSALayout(16, 16, 16, 16, 128, forced_initial=1, forced_local=1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    rope_scaling: RopeScaling | None = None
    attention: str = "dense"  # ATTENTION_KINDS
    nsa: NSALayout | None = None  # the layout of attention "nsa" and "nsa-view"

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise UnsupportedModelError(f"attention {self.attention!r}: one of {', '.join(ATTENTION_KINDS)}")
        if (self.nsa is None) != (self.attention == "dense"):
            raise UnsupportedModelError(f"attention {self.attention!r} with NSA layout {self.nsa}: a layout is "
                                        "needed exactly for the NSA kinds")
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if d.get("nsa") is not None:
            d["nsa"] = NSALayout(**d["nsa"])
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """From a Hugging Face `config.json`; anything that would change the math and is not implemented fails."""
        model_type = hf.get("model_type")
        if model_type == _NSA_MODEL_TYPE:
            return _nsa_from_hf(cls, hf)
        if model_type not in _HF_MODEL_TYPES:
            archs = hf.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"unknown architecture {archs[0]!r} (model_type {model_type!r}) in config.json; "
                f"supported model_type: {', '.join(sorted(_HF_MODEL_TYPES))}"
            )
        arch = _HF_MODEL_TYPES[model_type]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported config.json field hidden_act={act!r} (only 'silu')")
        if hf.get("sliding_window") is not None and (arch == "llama" or hf.get("use_sliding_window", False)):
            raise UnsupportedModelError(
                f"unsupported config.json field sliding_window={hf['sliding_window']} (sliding-window attention)"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("unsupported config.json field mlp_bias=true")
        if (hf.get("pretraining_tp") or 1) != 1:
            raise UnsupportedModelError(f"unsupported config.json field pretraining_tp={hf['pretraining_tp']}")
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        attention_bias = bool(hf.get("attention_bias", arch == "qwen2"))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "qwen3",
            rope_scaling=_rope_scaling_from_hf(hf),
        )


_NSA_MODEL_TYPE = "llama-nsa"
_NSA_ARCHITECTURE = "LlamaNSAForCausalLM"


def _nsa_from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
    """fla-org's NSA on Llama (zen-E/NSA-1B): Llama fields plus block_size (= compression block = stride =
    selection block, mean-pooled), block_counts (top-n, the query's block forced) and window_size."""
    archs = hf.get("architectures") or [_NSA_ARCHITECTURE]
    if archs[0] != _NSA_ARCHITECTURE:
        raise UnsupportedModelError(f"model_type {_NSA_MODEL_TYPE!r} with architecture {archs[0]!r}: only "
                                    f"{_NSA_ARCHITECTURE!r}")
    fields = {}
    for name in ("block_size", "block_counts", "window_size"):
        value = hf.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "window_size" else 1):
            raise UnsupportedModelError(f"unsupported config.json field {name}={value!r} (NSA needs an integer"
                                        f"{' >= 0' if name == 'window_size' else ' >= 1'})")
        fields[name] = value
    if hf.get("attention_bias"):
        raise UnsupportedModelError("unsupported config.json field attention_bias=true for an NSA model")
    block = fields["block_size"]
    try:
        layout = NSALayout(block, block, block, fields["block_counts"], fields["window_size"], forced_initial=0,
                           forced_local=1)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"config.json: {e}") from None
    dense = cls.from_hf({**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    return dataclasses.replace(dense, attention="nsa", nsa=layout)


def _rope_scaling_from_hf(hf: Mapping[str, Any]) -> RopeScaling | None:
    # transformers 5 moved `rope_scaling` into `rope_parameters`; accept both.
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"unsupported config.json field rope_scaling type {kind!r} (only 'llama3')")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def rope_inverse_frequencies(config: ModelConfig):
    """Per-pair inverse frequencies (numpy float64), with Llama-3 scaling applied."""
    import numpy as np

    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
