"""What every checkpoint loader returns."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from models.config import ModelConfig

if TYPE_CHECKING:
    from vegas_jax.loading.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # nested dict of jax arrays, layout of models.decoder.param_shapes(config)
    tokenizer: "Tokenizer"
    source: str  # path (or "embedded:SmolLM2-135M-Instruct") it was loaded from
    format: str  # "gguf" | "hf" | "orbax"
    # The mesh (axes data, model) the parameters are laid out on, their fused q/k/v heads in per-shard blocks
    # (models.decoder.fused_head_order); None: one device.
    mesh: Any = None
    # Quantized copies of the linear weights for draft passes (models.draft_weights), by precision, laid out like
    # the parameters: made once, by the loader from a checkpoint's own quantized blocks or on first use.
    drafts: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Per precision, where its draft weights came from (for the CLI's report).
    draft_sources: dict[str, str] = dataclasses.field(default_factory=dict)
    # The loader's way to make a precision's draft tree from the checkpoint's own quantized blocks, returning it and
    # where it came from (a GGUF file's); None: drafts are quantized from the parameters.
    native_drafts: Callable[["LoadedModel", str], tuple[Any, str]] | None = None

    def draft_params(self, precision: str, layout: str = "bytes"):
        """The draft tree of `precision` (None for bf16: the draft reads the model's own weights), made on first
        use and kept: from a GGUF file's own blocks where they have that precision, else quantized from the
        parameters. DraftWeightsError when the shapes admit no such draft. `layout`: how the codes are held, one
        row a byte ("bytes"), four rows a word for the integer kernel ("words", vegas_jax.decode.draft_kernel.
        codes_in_words), or transposed for the Mosaic GPU kernel ("transposed", codes_transposed); one copy
        kept."""
        if precision == "bf16":
            return None
        from vegas_jax.decode import draft_kernel

        if precision in self.drafts:
            self.drafts[precision] = draft_kernel.CODE_LAYOUTS[layout](self.drafts[precision])
            return self.drafts[precision]
        if self.native_drafts is not None:
            self.drafts[precision], self.draft_sources[precision] = self.native_drafts(self, precision)
        else:
            from vegas_jax.loading.placing import quantize_draft

            self.drafts[precision] = quantize_draft(self.params, self.config, precision, self.mesh)
            self.draft_sources[precision] = f"quantized from the {self.params['embed'].dtype} weights"
        return self.draft_params(precision, layout)

    @property
    def model_shards(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape["model"]

    def on_mesh(self, mesh) -> "LoadedModel":
        """The same model with its parameters laid out for another mesh (None: one device)."""
        from vegas_jax.loading.placing import relayout
        from vegas_jax.sharding import adopt_mesh

        from vegas_jax.loading.placing import relayout_draft

        mesh = None if mesh is None else adopt_mesh(mesh)
        params = relayout(self.params, self.config, self.model_shards, mesh)
        drafts = {p: relayout_draft(t, self.config, self.model_shards, mesh) for p, t in self.drafts.items()}
        return dataclasses.replace(self, params=params, mesh=mesh, drafts=drafts,
                                   draft_sources=dict(self.draft_sources))
