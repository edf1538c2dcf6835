"""The precision of the engine's dots follows its model's dtype (vegas_jax.runtime.compilation.matmul_precision): a float32
model's programs multiply in float32 on an NVIDIA GPU, XLA's dots at HIGHEST and the Pallas kernels' Triton dots at
IEEE precision, not TF32 (JAX's default for float32 there, which made greedy speculation differ from plain decoding
at near-ties, issue 49); a bf16 model's programs are as JAX makes them; and the user's own setting is the same
before, during (between a stream's chunks) and after a run.

The programs are checked as they would run on the GPU: the engine's own programs with the Pallas backend, lowered
for an H200 on this CPU (tests/h200_lowering.py: XLA's StableHLO and each kernel's Triton IR, without compiling),
with the Triton lowering's dot spied on for the input precision it gives each kernel dot."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import lowering as triton_lowering

from h200_lowering import lower_for_h200
from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine
from tests.test_nsa_trees import tiny_model
from vegas_jax.runtime import compilation
from vegas_jax.runtime import prefill
from vegas_jax.runtime import engine as engine_module
from vegas_jax.runtime.engine import Engine, GenerationOptions

# Each configuration's kernels: the sparse draft and verification kernels and radix top-k (vegas), the weight-only
# matmul of quantized drafts (int8), adaptive γ's passes of several widths (auto), tree attention (a dense tree),
# and the NSA tree kernels of SSV's exact class (an NSA model with the self drafter).
CONFIGURATIONS = {
    "vegas": ("dense", dict(method="vegas")),
    "streaming-int8": ("dense", dict(method="streaming", draft_weights="int8")),
    "vegas-auto": ("dense", dict(method="vegas", gamma="auto", gamma_max=4, gamma_costs=(1.2, 1.4, 1.6, 1.8))),
    "vegas-tree": ("dense", dict(method="vegas", gamma=2, draft_tree="2x2")),
    "nsa-tree": ("nsa", dict(gamma=2, draft_tree="2x2")),
}


class NotRun(Exception):
    """A program that was lowered for the GPU, not compiled for this CPU, was called."""


def in_dtype(engine: Engine, dtype) -> Engine:
    params = jax.tree.map(lambda x: x.astype(dtype), engine.model.params)
    return Engine(dataclasses.replace(engine.model, params=params))


def gpu_programs(engine: Engine, options: GenerationOptions, monkeypatch,
                 backend: str = "pallas") -> dict[str, tuple[str, list]]:
    """The engine's prefill chunk, bootstrap step and decode loop for these options with the Pallas kernels (or
    their jnp twins, backend "reference"), each as (StableHLO lowered for an H200, [(Triton dot operand type,
    input precision)] of its kernels)."""
    programs, dots = {}, []
    real_dialect = triton_lowering.tt_dialect

    class Spy:
        def __getattr__(self, name):
            return getattr(real_dialect, name)

        def dot(self, a, b, *rest, input_precision=None, **kwargs):
            dots.append((str(a.type), str(input_precision)))
            return real_dialect.dot(a, b, *rest, input_precision=input_precision, **kwargs)

    def lower(fn, *args, donate=()):
        dots.clear()
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        text = lower_for_h200(jax.jit(fn, donate_argnums=donate), *shapes)
        programs[getattr(fn, "func", fn).__name__] = text, list(dots)

        def not_run(*_):
            raise NotRun

        return not_run

    monkeypatch.setattr(triton_lowering, "tt_dialect", Spy())
    monkeypatch.setattr(compilation, "compile_jitted", lower)
    monkeypatch.setattr(engine_module, "default_backend", lambda: backend)
    ids = prompts([45, 12], engine.config.vocab_size)
    with pytest.raises(NotRun):  # compiles (here: lowers) prefill and the bootstrap step, then runs prefill
        engine.start(ids, options)
    plan = engine._fitted_plan(ids, options)
    state = prefill.initial_state(engine.model, engine.programs, ids, plan.options, plan.config, plan.capacity,
                                  engine._stop_table(plan.options), 0)  # the shapes the loop starts from
    engine._compile_decode(plan.config, state, engine._draft_params(plan.config, len(ids)), {})
    assert set(programs) == {"prefill_chunk", "bootstrap", "decode"}
    return programs


def xla_dot_precisions(text: str) -> list[str]:
    """The precision of each XLA dot of a StableHLO module ("DEFAULT" where none is given); the kernels are opaque
    custom calls in it, so these are XLA's alone."""
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    return [m.group(1) if (m := re.search(r"precision = \[(\w+), \w+\]", d)) else "DEFAULT" for d in dots]


def engine_for(kind: str) -> Engine:
    return tiny_engine() if kind == "dense" else tiny_model("nsa-1b")


@pytest.mark.parametrize("name,backend", [(name, "pallas") for name in CONFIGURATIONS]
                         + [("vegas", "reference"), ("nsa-tree", "reference")])
def test_float32_programs_multiply_in_float32_on_the_gpu(name, backend, monkeypatch):
    kind, fields = CONFIGURATIONS[name]
    engine = engine_for(kind)
    options = dataclasses.replace(GREEDY, max_new_tokens=16, **fields)
    with jax.default_matmul_precision("bfloat16"):  # the user's own choice, for the user's own code
        programs = gpu_programs(engine, options, monkeypatch, backend)
        assert jax.config.jax_default_matmul_precision == "bfloat16"
    assert jax.config.jax_default_matmul_precision is None
    for program, (text, kernel_dots) in programs.items():
        assert set(xla_dot_precisions(text)) == {"HIGHEST"}, program
        float32_dots = [precision for operand, precision in kernel_dots if "xf32>" in operand]
        assert set(float32_dots) <= {"ieee"}, (program, kernel_dots)
    if backend == "pallas":  # not vacuous: the verification and draft kernels' float32 dots went through the spy
        assert any(kernel_dots for _, kernel_dots in programs.values())
        assert "__gpu$xla.gpu.triton" in programs["decode"][0]


@pytest.mark.parametrize("name", ["vegas", "nsa-tree"])
def test_bf16_programs_keep_jax_default(name, monkeypatch):
    """bf16 operands have no TF32 to avoid: their dots keep JAX's default (the fast path), in XLA and in Triton."""
    kind, fields = CONFIGURATIONS[name]
    engine = in_dtype(engine_for(kind), jnp.bfloat16)
    programs = gpu_programs(engine, dataclasses.replace(GREEDY, max_new_tokens=16, **fields), monkeypatch)
    for program, (text, kernel_dots) in programs.items():
        assert "HIGHEST" not in xla_dot_precisions(text), program
        assert "ieee" not in {precision for _, precision in kernel_dots}, program
    assert any(kernel_dots for _, kernel_dots in programs.values())


def test_a_run_leaves_the_users_precision_alone():
    """Between a stream's chunks the user's code runs with the user's setting (a float32 engine's programs are
    traced in a context of their own, entered and left within each compilation, never across a yield)."""
    engine = tiny_engine()
    batch = prompts([30, 9], engine.config.vocab_size)
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=12)
    with jax.default_matmul_precision("tensorfloat32"):
        chunks = 0
        for _ in engine.stream(batch, options, steps_per_call=2):
            assert jax.config.jax_default_matmul_precision == "tensorfloat32"
            chunks += 1
        assert chunks > 2
        user_dot = jax.make_jaxpr(lambda a: a @ a)(np.ones((2, 2), np.float32)).eqns[0]
        assert user_dot.params["precision"] == (jax.lax.Precision.HIGH,) * 2  # tensorfloat32, as the user asked
    assert jax.config.jax_default_matmul_precision is None
    assert engine.programs.matmul_precision == "highest"
    assert in_dtype(engine, jnp.bfloat16).programs.matmul_precision is None
