"""The scanned layers read and write the stacked KV cache in place: inside the compiled decode loop no instruction
materialises one layer's keys or values (a slice taken out of the stack, a copy, a transpose) and none copies the
whole stack. A layer's attention reads its rows straight out of the carried [L, B, T, H, D] array and writes only
the new tokens' rows back into it. On the issue-52 branch each layer's [B, T, H, D] slice was cut out, updated and
written back, which XLA compiles to a copy of the layer's cache per layer and pass (3.5x slower plain decode,
7.7x slower Vegas on an H100: benchmarks/results/scan-decode-2026-12-05-h100.json); this test catches that
design.

The check reads XLA's compiled CPU program (`Compiled.as_text()`): every instruction outside fusions is a buffer
XLA allocates or writes, so an instruction whose result has one layer's cache size is a copy of a layer.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine

LAYERS = 3
KV_HEADS, HEAD_DIM = 2, 16  # tiny_engine's

# `%name = TYPE opcode(` where TYPE is an array or a tuple of arrays.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-_]*)\(")
_ARRAY = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")
# Instructions that name a buffer without writing one.
_ALIASING = {"parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "call",
             "constant", "after-all", "opt-barrier"}


def fused_computations(hlo: str) -> set[str]:
    """Names of the computations that fusions call: their instructions are registers, not buffers."""
    return set(re.findall(r"fusion\(.*?calls=%([^\s,]+)", hlo))


def cache_copies(hlo: str) -> list[str]:
    """The instructions of a compiled program that write a buffer of one layer's K or V cache ([B, T, H_kv, D]
    elements with a T axis, whatever its layout), or copy a whole stacked cache [L, B, T, H_kv, D]."""
    stacks = {tuple(map(int, dims.split(","))) for dims in _ARRAY.findall(hlo)
              if dims.count(",") == 4 and _is_stack(tuple(map(int, dims.split(","))))}
    assert stacks, "no stacked cache [L, B, T, H_kv, D] in the program"
    layer_sizes = {(s[1] * s[2] * s[3] * s[4], s[2]) for s in stacks}
    fused = fused_computations(hlo)
    found, computation = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            header = re.match(r"^(?:ENTRY )?%(\S+)", line)
            computation = header.group(1) if header else None
            continue
        match = _INSTRUCTION.match(line)
        if match is None or computation in fused or match.group(3) in _ALIASING:
            continue
        for dims in _ARRAY.findall(match.group(2)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            size = 1
            for d in shape:
                size *= d
            layer_sized = any(size == n and capacity in shape for n, capacity in layer_sizes)
            if layer_sized or (match.group(3) == "copy" and shape in stacks):
                found.append(f"{computation}: {line.strip()[:200]}")
    return found


def _is_stack(shape: tuple[int, ...]) -> bool:
    return shape[0] == LAYERS and shape[3:] == (KV_HEADS, HEAD_DIM)


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
