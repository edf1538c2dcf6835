"""Which lines of this repository a compiled program's kernels come from.

A GPU profile names an XLA fusion's kernel after its HLO instruction (`loop_pad_fusion.30` runs as
`loop_pad_fusion_30`), and an optimized HLO module's text keeps, for every instruction, the Python frames that
traced it (`metadata={... stack_frame_id=N}` and the module's FileNames / FunctionNames / FileLocations /
StackFrames tables). Joining the two turns a profile's anonymous fusions into lines of code, which is what a
decision about fusing or removing them needs. Library GEMMs (cuBLAS, CUTLASS) run under library kernel names that
say nothing of their HLO op, so the program's products are listed from the HLO instead: operand shapes and the line
of each, counted.
"""

from __future__ import annotations

import collections
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_LOCATION = re.compile(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
_FRAME = re.compile(r"file_location_id=(\d+) parent_frame_id=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (?:\S+ )*?([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_STACK = re.compile(r"stack_frame_id=(\d+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas", re.I)


def kernel_name(instruction: str) -> str:
    """The name a GPU profile gives the kernel of HLO instruction `instruction` ('.' and '-' become '_')."""
    return re.sub(r"[.\-]", "_", instruction)


def _tables(text: str) -> dict[str, dict[int, str]]:
    """The module's FileNames, FunctionNames, FileLocations and StackFrames tables: id -> the row's text."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (row := _TABLE_ROW.match(line)):
            current[int(row.group(1))] = row.group(2)
        elif current is not None and line.strip():
            current = None
    return tables


def _shown(path: str) -> str:
    """A traced file's path as shown: relative to the repository where inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return Path(path).name


class _Frames:
    """Resolves a stack_frame_id to its frames, innermost first, as 'file:line function'."""

    def __init__(self, text: str):
        t = _tables(text)
        self.files = {i: _shown(name.strip('"')) for i, name in t.get("FileNames", {}).items()}
        self.functions = {i: name.strip('"') for i, name in t.get("FunctionNames", {}).items()}
        self.locations = {i: m.groups() for i, row in t.get("FileLocations", {}).items()
                          if (m := _LOCATION.search(row))}
        self.parents = {i: tuple(int(g) for g in m.groups()) for i, row in t.get("StackFrames", {}).items()
                        if (m := _FRAME.search(row))}

    def chain(self, frame_id: int, depth: int) -> list[str]:
        frames, seen = [], set()
        while frame_id in self.parents and frame_id not in seen and len(frames) < depth:
            seen.add(frame_id)
            location, parent = self.parents[frame_id]
            file_id, function_id, line = self.locations.get(location, (None, None, None))
            if file_id is not None:
                frames.append(f"{self.files.get(int(file_id), '?')}:{line} "
                              f"{self.functions.get(int(function_id), '?')}")
            frame_id = parent - 1  # the text format writes a frame's parent as its id + 1 (0: none)
        return frames


def _computations(text: str) -> dict[str, list[dict]]:
    """Computation name -> its instructions, each {name, shape, op, calls, root, frame, target}."""
    computations, current = {}, None
    for line in text.splitlines():
        if (c := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
            current = computations.setdefault(c.group(1), [])
            continue
        if current is None or not (m := _INSTRUCTION.match(line)):
            continue
        calls, frame, target = _CALLS.search(line), _STACK.search(line), _TARGET.search(line)
        shape = re.sub(r"\{[^}]*\}", "", m.group(2)).strip("(,")  # a tuple's first element, layouts dropped
        instruction = {"name": m.group(1), "shape": shape, "op": m.group(3), "root": "ROOT " in line[:12],
                       "calls": calls.group(1) if calls else None, "frame": int(frame.group(1)) if frame else None,
                       "target": target.group(1) if target else None}
        current.append(instruction)
    return computations


@functools.lru_cache(maxsize=2)
def _parsed(text: str) -> tuple[_Frames, dict[str, list[dict]]]:
    """The module's frames and computations, parsed once for kernel_sources and products of the same text."""
    return _Frames(text), _computations(text)


def kernel_sources(text: str, depth: int = 2) -> dict[str, dict]:
    """For each fusion of the optimized HLO module `text`, by its kernel name: {"op": its root's opcode,
    "source": the root's frames (innermost first, up to `depth`), "lines": the distinct innermost lines of the
    fused instructions, most frequent first}."""
    frames, computations = _parsed(text)
    sources = {}
    for instructions in computations.values():
        for ins in instructions:
            if ins["op"] != "fusion" or ins["calls"] not in computations:
                continue
            body = computations[ins["calls"]]
            root = next((i for i in body if i["root"]), body[-1] if body else None)
            frame = root["frame"] if root and root["frame"] is not None else ins["frame"]
            lines = collections.Counter(chain[0] for i in body if i["frame"] is not None
                                        for chain in [frames.chain(i["frame"], 1)] if chain)
            sources[kernel_name(ins["name"])] = {
                "op": root["op"] if root else None,
                "source": " < ".join(frames.chain(frame, depth)) if frame is not None else "",
                "lines": [line for line, _ in lines.most_common(4)],
            }
    return sources


def products(text: str, depth: int = 2) -> list[dict]:
    """The program's matrix products (custom calls to cuBLAS / cuBLASLt, fusions whose body holds a dot, dots
    left unfused), counted by (output shape, source): [{"shape", "source", "count"}], most
    frequent first."""
    frames, computations = _parsed(text)
    fused = {ins["calls"] for instructions in computations.values() for ins in instructions if ins["op"] == "fusion"}
    counts = collections.Counter()
    for name, instructions in computations.items():
        for ins in instructions:
            is_library = ins["op"] == "custom-call" and ins["target"] and _GEMM_TARGET.search(ins["target"])
            is_fused = ins["op"] == "fusion" and any(i["op"] == "dot" for i in computations.get(ins["calls"], []))
            is_plain = ins["op"] == "dot" and name not in fused  # a dot left unfused (XLA:CPU's own GEMM call)
            if not (is_library or is_fused or is_plain):
                continue
            frame = ins["frame"]
            if frame is None and is_fused:
                frame = next((i["frame"] for i in computations[ins["calls"]] if i["op"] == "dot"), None)
            source = " < ".join(frames.chain(frame, depth)) if frame is not None else ""
            counts[ins["shape"], source] += 1
    return [{"shape": shape, "source": source, "count": n} for (shape, source), n in counts.most_common()]
