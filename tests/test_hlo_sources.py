"""benchmarks/hlo_sources.py: a compiled program's fusions and products named by the lines that traced them,
checked against this file's own line numbers."""

import inspect

import jax
import jax.numpy as jnp

from benchmarks import hlo_sources


def _padded_rows(x):
    return jnp.pad(x, ((0, 7), (0, 0)))


def _normed_product(x, w):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
    return jnp.tanh(_padded_rows(h) @ w).sum(axis=0)


def _line_of(function, text: str) -> str:
    """'tests/test_hlo_sources.py:N name' for the line of `function` holding `text`."""
    lines, first = inspect.getsourcelines(function)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"tests/test_hlo_sources.py:{first + offset} {function.__name__}"


def _compiled_text() -> str:
    return jax.jit(_normed_product).lower(jnp.ones((1, 64)), jnp.ones((64, 32))).compile().as_text()


def test_each_fusion_is_named_by_the_lines_that_traced_it():
    sources = hlo_sources.kernel_sources(_compiled_text(), depth=2)
    pad_line, product_line = _line_of(_padded_rows, "jnp.pad"), _line_of(_normed_product, "@ w")
    (pad,) = [s for s in sources.values() if s["op"] == "pad"]
    # The pad's own line first, then its caller's.
    assert pad["source"] == f"{pad_line} < {product_line}"
    assert pad_line in pad["lines"]
    assert all(name == hlo_sources.kernel_name(name) for name in sources)  # names as a profiler shows them


def test_products_are_counted_by_shape_and_line():
    (product,) = hlo_sources.products(_compiled_text(), depth=1)
    assert product == {"shape": "f32[8,32]", "source": _line_of(_normed_product, "@ w"), "count": 1}


def test_library_gemms_are_listed_from_their_custom_calls():
    """A GPU module's cuBLAS call (XLA's text format: a tuple-shaped custom call; a frame's parent written as its
    id + 1), twice in a loop body."""
    text = "\n".join([
        "HloModule m", "", "FileNames", '1 "/elsewhere/models/decoder.py"', "", "FunctionNames", '1 "contract"',
        '2 "__call__"', "", "FileLocations", "1 {file_name_id=1 function_name_id=2 line=127 end_line=127}",
        "2 {file_name_id=1 function_name_id=1 line=64 end_line=64}", "", "StackFrames",
        "1 {file_location_id=1 parent_frame_id=0}", "2 {file_location_id=2 parent_frame_id=2}", "", "",
        "%body (p: bf16[9,576]) -> bf16[9,960] {",
        "  %p = bf16[9,576]{1,0} parameter(0)",
        '  %custom-call.1 = (bf16[9,960]{1,0}, s8[4194304]{0}) custom-call(%p, %p), '
        'custom_call_target="__cublas$gemm", metadata={op_name="dot_general" stack_frame_id=2}',
        '  %custom-call.2 = (bf16[9,960]{1,0}, s8[4194304]{0}) custom-call(%p, %p), '
        'custom_call_target="__cublas$gemm", metadata={op_name="dot_general" stack_frame_id=2}',
        "  ROOT %t = bf16[9,960]{1,0} get-tuple-element(%custom-call.2), index=0",
        "}",
    ])
    assert hlo_sources.products(text) == [
        {"shape": "bf16[9,960]", "source": "decoder.py:64 contract < decoder.py:127 __call__", "count": 2}]
