"""The scanned layers read and write the stacked KV cache in place: inside the compiled decode loop no instruction
materialises one layer's keys or values (a slice taken out of the stack, a copy, a transpose) and none copies the
whole stack. A layer's attention reads its rows straight out of the carried [L, B, T, H, D] array and writes only
the new tokens' rows back into it. On the issue-52 branch each layer's [B, T, H, D] slice was cut out, updated and
written back, which XLA compiles to a copy of the layer's cache per layer and pass (3.5x slower plain decode,
7.7x slower Vegas on an H100: benchmarks/results/scan-decode-2026-12-05-h100.json); this test catches that
design.

The check reads XLA's compiled CPU program (`Compiled.as_text()`): every instruction outside fusions is a buffer
XLA allocates or writes, so an instruction whose result has one layer's cache size is a copy of a layer.

Programs lowered for an H200 show the kernels' operands: each kernel that reads the cache takes the whole stack, and
each weight-only kernel of a quantized draft the whole stacked draft weights, never a layer's slice.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine

LAYERS = 3
KV_HEADS, HEAD_DIM = 2, 16  # tiny_engine's
CACHE_DTYPE = "f32"  # tiny_engine's float32 model

# `%name = TYPE opcode(` where TYPE is an array or a tuple of arrays.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-_]*)\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
# Instructions that name a buffer without writing one.
_ALIASING = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "call",
             "constant", "after-all", "opt-barrier"}


def fused_computations(hlo: str) -> set[str]:
    """Names of the computations that fusions call: their instructions are registers, not buffers."""
    return set(re.findall(r"fusion\(.*?calls=%([^\s,]+)", hlo))


def transposing_fusions(hlo: str) -> set[str]:
    """Names of the fusion instructions whose computation transposes: CPU XLA's dots take a batched operand with
    its batch axes (B, KV head) leading, so the jnp attention's q.k and p.v products read a layer's K and V
    [B, T, H_kv, D] through a transposed copy. That is the CPU dot's operand layout, made from main's per-layer
    arrays as well; the GPU runs the Pallas kernels, which read the stacks as they lie
    (test_kernels_take_the_whole_stacked_cache)."""
    transposing, computation = set(), None
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            header = re.match(r"^(?:ENTRY )?%(\S+)", line)
            computation = header.group(1) if header else None
        elif (match := _INSTRUCTION.match(line)) and match.group(3) == "transpose":
            transposing.add(computation)
    return {name for name, called in re.findall(r"%(\S+) = [^\n]*? fusion\(.*?calls=%([^\s,]+)", hlo)
            if called in transposing}


def cache_copies(hlo: str, dims: tuple[int, int, int] = (LAYERS, KV_HEADS, HEAD_DIM),
                 skip_dots: bool = False) -> list[str]:
    """The instructions of a compiled program that write a buffer of one layer's K or V cache ([B, T, H_kv, D]
    elements with a T axis, whatever its layout), or copy a whole stacked cache [L, B, T, H_kv, D] (dims: the
    stacks' (L, H_kv, D); an NSA cache's compressed stacks [L, B, C, H_kv, D] count as well). skip_dots: leave out
    XLA CPU's XNNPACK dot fusions (kind=kCustom), whose results are products, never a copy of the cache (the NSA
    model's attention logits [B, H_kv, S, T] have a layer's element count when S = D)."""
    stacks = {tuple(map(int, d.split(","))) for dtype, d in _ARRAY.findall(hlo)
              if dtype == CACHE_DTYPE and d.count(",") == 4 and _is_stack(tuple(map(int, d.split(","))), dims)}
    assert stacks, "no stacked cache [L, B, T, H_kv, D] in the program"
    layer_sizes = {(s[1] * s[2] * s[3] * s[4], s[2]) for s in stacks}
    fused, transposes = fused_computations(hlo), transposing_fusions(hlo)
    found, computation = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            header = re.match(r"^(?:ENTRY )?%(\S+)", line)
            computation = header.group(1) if header else None
            continue
        match = _INSTRUCTION.match(line)
        if match is None or computation in fused or match.group(3) in _ALIASING or match.group(1) in transposes:
            continue
        if skip_dots and "kind=kCustom" in line:
            continue
        for dtype, shape_dims in _ARRAY.findall(match.group(2)):
            if dtype != CACHE_DTYPE:  # a mask or index array that happens to have a layer's element count
                continue
            shape = tuple(int(d) for d in shape_dims.split(",") if d)
            size = 1
            for d in shape:
                size *= d
            layer_sized = any(size == n and capacity in shape for n, capacity in layer_sizes)
            if layer_sized or (match.group(3) == "copy" and shape in stacks):
                found.append(f"{computation}: {line.strip()[:200]}")
    return found


def _is_stack(shape: tuple[int, ...], dims: tuple[int, int, int]) -> bool:
    return shape[0] == dims[0] and shape[3:] == dims[1:]


# The programs that run the layers over the cache: prefill chunks, the first decode step, the decode loop.
CACHE_PROGRAMS = ("prefill", "bootstrap", "decode")


def cache_programs(engine) -> dict[str, str]:
    """The compiled text of every program of CACHE_PROGRAMS the engine compiled, by name and number."""
    texts = {}
    for i, key in enumerate(engine.programs):
        if key[0] in CACHE_PROGRAMS:
            texts[f"{key[0]}#{i}"] = engine.programs._programs[key].as_text()
    return texts


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(layers=LAYERS)


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_programs_never_copy_a_layers_cache(engine, method):
    options = dataclasses.replace(GREEDY, method=method, max_new_tokens=8)
    engine.generate(prompts([40, 21], engine.config.vocab_size), options)
    programs = cache_programs(engine)
    assert {name.split("#")[0] for name in programs} == set(CACHE_PROGRAMS)
    for name, hlo in programs.items():
        assert "while" in hlo  # the scanned layers are a while loop
        assert cache_copies(hlo) == [], name


# The NSA caches (models.nsa_cache.NSACache: raw k, v and compressed k_cmp, v_cmp, all [L, B, rows, H_kv, D]) on a
# tiny random 3-layer NSA checkpoint. Its widths (48) keep every weight's element count off a layer cache's.
def nsa_engine():
    import pathlib
    import tempfile

    import jax.numpy as jnp

    from tests.test_nsa import TINY_NSA, write_tiny_nsa
    from vegas_jax.loading import load_model
    from vegas_jax.runtime.engine import Engine

    config = {**TINY_NSA, "num_hidden_layers": LAYERS, "hidden_size": 48, "intermediate_size": 48}
    return Engine(load_model(write_tiny_nsa(pathlib.Path(tempfile.mkdtemp()), config), jnp.float32))


@pytest.mark.parametrize("fields", [
    {},  # plain NSA decoding
    dict(draft_tree="3x2", drafter="self"),  # the SSV tree loop: NSATreeVerify, SinkWindowDraft, commit_path
    dict(draft_tree="3x2", drafter="self", precision="approximate", approx_mode="s2w1r2"),  # a modified target
], ids=["decode", "ssv-tree", "ssv-approximate"])
def test_nsa_programs_never_copy_a_layers_cache(fields):
    """The NSA attentions read and write the stacked NSA cache in place (NSACache.at_layer): no compiled
    instruction writes a buffer of one layer's k, v, k_cmp or v_cmp. The approximate mode's full passes run the
    layers unrolled (refresh and reuse layers differ: decoder.layer_specific), with a static layer index, and are
    checked the same."""
    from tests.test_nsa import DIM, KV_HEADS as NSA_KV_HEADS
    from vegas_jax.runtime.engine import GenerationOptions

    engine = nsa_engine()
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 288, 52).tolist(), rng.integers(3, 288, 37).tolist()]
    engine.generate(ids, GenerationOptions(max_new_tokens=8, **fields))
    programs = {f"{key[0]}#{i}": engine.programs._programs[key].as_text() for i, key in enumerate(engine.programs)
                if key[0] in CACHE_PROGRAMS}
    assert {name.split("#")[0] for name in programs} == set(CACHE_PROGRAMS)
    for name, hlo in programs.items():
        assert cache_copies(hlo, (LAYERS, NSA_KV_HEADS, DIM), skip_dots=True) == [], name


# A StableHLO tensor type: `tensor<3x2x384x2x16xf32>`.
_TENSOR = re.compile(r"tensor<((?:\d+x)+)([a-z0-9]+)>")


def _tensor_shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.rstrip("x").split("x")) for dims, dtype in _TENSOR.findall(text)
            if dtype == CACHE_DTYPE]


def kernel_cache_operands(stablehlo: str) -> list[tuple[int, ...]]:
    """The cache-shaped operands ([..., T, H_kv, D]) of every Triton kernel call of a StableHLO module."""
    shapes = []
    for line in stablehlo.splitlines():
        if "__gpu$xla.gpu.triton" in line and " : (" in line:
            operands = line.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
            shapes += [s for s in _tensor_shapes(operands) if len(s) >= 3 and s[-2:] == (KV_HEADS, HEAD_DIM)]
    return shapes


def stack_transposes(stablehlo: str, stack: tuple[int, ...]) -> list[str]:
    """The StableHLO ops that transpose (copy) a whole stacked cache: a kernel reading the stack along another
    axis order than it lies in (as Pallas's vmap makes of an aliased operand batched at axis 1)."""
    return [line.strip()[:200] for line in stablehlo.splitlines()
            if "stablehlo.transpose" in line and stack in _tensor_shapes(line)]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("method,fields", [("vegas", {}), ("vegas-tree", dict(gamma=2, draft_tree="2x2"))])
def test_kernels_take_the_whole_stacked_cache(method, fields, monkeypatch):
    """The programs lowered for an H200 with the Pallas kernels (tests/h200_lowering.py): every kernel that reads
    or writes the cache (verification, sparse draft, tree attention) takes the whole stack [L, B, T, H_kv, D] as its
    operand (the layer is a scalar operand it indexes with), never a layer's slice: a kernel's operand is a
    buffer, so a slice there would be a copy of the layer's cache per pass, whatever XLA fuses. Nor is a stack
    transposed for a kernel. (A tree's draft passes run the jnp attention, whose dots read the layer through
    XLA's transposed operand copy, as they read main's per-layer arrays.)"""
    from tests.test_matmul_precision import gpu_programs

    engine = tiny_engine(layers=LAYERS)
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=16, **fields)
    programs = gpu_programs(engine, options, monkeypatch)
    for name, (text, _) in programs.items():
        operands = kernel_cache_operands(text)
        assert operands, f"{name}: no kernel reads the cache"
        stacks = set(operands)
        assert len(stacks) == 1 and len(next(iter(stacks))) == 5 and next(iter(stacks))[0] == LAYERS, \
            (name, stacks)
        assert stack_transposes(text, next(iter(stacks))) == [], name


def weight_kernel_operands(stablehlo: str) -> list[tuple[str, list[tuple[tuple[int, ...], str]]]]:
    """(kernel, [(shape, dtype) of each weight operand]) of every weight-only kernel call of a StableHLO module: the
    Triton-lowered kernels' (by name) and the Mosaic GPU kernel's ("mosaic"). Its operands are x (the integer
    kernels: x's int8 codes and their scales), the layer (Triton: a scalar, no array; Mosaic GPU: a vector of two
    int32) and the weight's arrays."""
    calls = []
    for line in stablehlo.splitlines():
        if "stablehlo.custom_call" in line and "weight_only_matmul" in line and " : (" in line:
            kernel = "mosaic" if "@mosaic_gpu" in line else re.search(r'name = "(weight_only_\w+)"', line).group(1)
            operands = line.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
            arrays = [(tuple(int(d) for d in dims.rstrip("x").split("x")), dtype)
                      for dims, dtype in _TENSOR.findall(operands)]
            x_operands = 2 if "integer" in kernel else 1
            calls.append((kernel, [a for a in arrays[x_operands:] if len(a[0]) > 1]))
    return calls


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("draft_weights,activations,hopper", [
    ("int8", "bf16", False), ("int4", "bf16", False), ("int4", "int8", False),  # int8 rows: the integer kernels
    ("int8", "bf16", True), ("int4", "bf16", True)])
def test_weight_kernels_take_the_whole_stacked_draft_weights(draft_weights, activations, hopper, monkeypatch):
    """The decode program lowered for an H200 with the Pallas kernels, Vegas drafting with quantized weights: every
    weight-only kernel takes each stacked layer weight's codes, scales and offsets whole [L, ...] (the layer is an
    operand it indexes with), never a layer's slice, which as a kernel's operand would be a buffer of its own: a
    copy of every draft weight per layer and draft pass. The LM head, no layer weight, comes as a stack of one.
    `hopper`: as on a Hopper GPU, where the engine holds the codes transposed for the Mosaic GPU kernel
    (draft_kernel.code_layout); this model's scales are float32, which that kernel converts to its bf16 for the
    layer alone (weight_only_mgpu), so there its codes are checked."""
    from tests.test_matmul_precision import gpu_programs
    from vegas_jax.decode import draft_kernel

    monkeypatch.setattr(draft_kernel, "_hopper", lambda: hopper)
    engine = tiny_engine(layers=LAYERS)
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=16, draft_weights=draft_weights,
                                  draft_activations=activations)
    text, _ = gpu_programs(engine, options, monkeypatch)["decode"]
    calls = weight_kernel_operands(text)
    kernels = {kernel for kernel, _ in calls}
    assert ("mosaic" in kernels) == hopper and any(k.startswith("weight_only_matmul_") for k in kernels), kernels
    if activations == "int8":
        assert "weight_only_matmul_integer_rows" in kernels, kernels
    vocab = engine.config.vocab_size
    for kernel, weights in calls:
        if kernel == "mosaic":
            weights = [(shape, dtype) for shape, dtype in weights if dtype in ("i4", "i8")]
        assert weights, kernel
        for shape, dtype in weights:
            assert shape[0] == LAYERS or (shape[0] == 1 and vocab in shape), (kernel, weights)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("fields", [{}, dict(gamma=2, draft_tree="2x2")], ids=["decode", "ssv-tree"])
def test_nsa_kernels_take_the_whole_stacked_cache(fields, monkeypatch):
    """The NSA programs lowered for an H200 with the Pallas kernels: every NSA kernel that reads the cache (plain
    decoding's compressed and sparse-window kernels, tree verification's compressed and selected-branch kernels)
    takes whole stacks [L, B, rows, H_kv, D] (raw or compressed), never a layer's slice, and none is transposed."""
    from tests.test_matmul_precision import gpu_programs
    from tests.test_nsa_trees import tiny_model

    engine = tiny_model("nsa-1b")
    c = engine.config
    options = dataclasses.replace(GREEDY, max_new_tokens=16, **fields)
    for name, (text, _) in gpu_programs(engine, options, monkeypatch).items():
        if name == "prefill_chunk":  # many tokens a pass: the jnp attention, no kernel
            continue
        shapes = set()
        for line in text.splitlines():
            if "__gpu$xla.gpu.triton" in line and " : (" in line:
                operands = line.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
                cache_like = lambda s: len(s) >= 4 and s[-2:] == (c.num_kv_heads, c.head_dim)  # noqa: E731
                shapes |= {s for s in _tensor_shapes(operands) if cache_like(s)}
        assert shapes, name
        assert all(len(s) == 5 and s[0] == c.num_layers for s in shapes), (name, shapes)
        # The tree pass's jnp row gathers (the prefix rows of the compressed blocks a path completes, the window)
        # read the whole stacks at the sequence's index, not the vmapped view (a transpose of the stacks).
        for stack in shapes:
            assert stack_transposes(text, stack) == [], name
