"""benchmarks/profile_decode.py's trace reading, on a synthetic trace in the JAX profiler's format (no GPU here)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.profile_decode import gpu_kernel_events, kernel_kind, summarize


def write_trace(tmp_path, events):
    folder = tmp_path / "plugins" / "profile" / "2026_11_30"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events, "metadata": {}}, f)


def test_only_complete_events_on_gpu_timelines_count(tmp_path):
    meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
    kernel = lambda pid, name, dur, op="command_buffer_3": {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur,
                                                            "name": name, "args": {"hlo_op": op}}
    write_trace(tmp_path, [
        meta(1, "/host:CPU"), meta(7, "/device:GPU:0"),
        kernel(1, "python_function", 500.0),  # host timeline: not a kernel
        kernel(7, "verify_attention_logit", 120.0),
        kernel(7, "nvjet_sm90_tst_64x8", 4.0),
        kernel(7, "nvjet_sm90_tst_64x8", 4.0),
        kernel(7, "loop_add_fusion_3", 2.0, op="command_buffer_11"),
        {"ph": "i", "pid": 7, "name": "instant"},  # not a complete event
    ])
    events = gpu_kernel_events(tmp_path)
    assert sorted(e["name"] for e in events) == sorted(
        ["verify_attention_logit", "nvjet_sm90_tst_64x8", "nvjet_sm90_tst_64x8", "loop_add_fusion_3"])

    summary = summarize(events, iterations=2, wall_s=0.001, top=2)
    assert summary["kernels_per_iteration"] == 2.0
    assert summary["gpu_busy_ms_per_iteration"] == pytest.approx(0.065)
    assert summary["wall_ms_per_iteration"] == pytest.approx(0.5)
    assert summary["by_kind"]["pallas"] == {"kernels_per_iteration": 0.5, "ms_per_iteration": pytest.approx(0.06)}
    assert summary["by_kind"]["gemm"]["kernels_per_iteration"] == 1.0
    assert summary["by_enclosing_op"]["command_buffer_3"]["ms_per_iteration"] == pytest.approx(0.064)
    assert summary["by_enclosing_op"]["command_buffer_11"] == {"kernels_per_iteration": 0.5,
                                                               "ms_per_iteration": pytest.approx(0.001)}
    top = summary["top_kernels"]
    assert [k["calls_per_iteration"] for k in top] == [0.5, 1.0]
    assert top[0]["kernel"].startswith("verify_attention_logit [command_buffer_3]")
    assert top[1]["mean_us"] == 4.0


def test_fusions_carry_the_lines_they_were_traced_from():
    """A top kernel whose name (before its command buffer) is a fusion of the program's HLO takes that fusion's
    op and lines (benchmarks/hlo_sources.kernel_sources); a library kernel takes none."""
    kernel = lambda name, dur: {"ph": "X", "pid": 7, "dur": dur, "name": name, "args": {"hlo_op": "command_buffer_3"}}
    pad = {"op": "pad", "source": "models/nsa_selection.py:43 pooled", "lines": ["models/nsa_selection.py:43 pooled"]}
    summary = summarize([kernel("loop_pad_fusion_30", 8.0), kernel("nvjet_sm90_tst_64x8", 4.0)], iterations=1,
                        wall_s=0.001, top=2, sources={"loop_pad_fusion_30": pad, "loop_pad_fusion_3": {"op": "x"}})
    assert summary["top_kernels"][0] == {"kernel": "loop_pad_fusion_30 [command_buffer_3]", "calls_per_iteration": 1.0,
                                         "ms_per_iteration": 0.008, "mean_us": 8.0, **pad}
    assert "source" not in summary["top_kernels"][1]


@pytest.mark.parametrize("name, kind", [
    ("sparse_decode_attention__12", "pallas"), ("count_at_least", "pallas"), ("compact_selected", "pallas"),
    ("gemm_fusion_dot_1000", "gemm"), ("nvjet_sm90_tst_32x64", "gemm"), ("memcpy32_post", "copy"),
    ("input_scatter_fusion_58", "xla_fusion"),
])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind
