"""Every GPU benchmark script's --smoke, run on the CPU in-process: the script runs end to end and what it saves
is sane (records with the fields its docstring names, finite timings, kernels equal to their twins, Vegas equal to
plain decoding). A script that crashes here would crash on its first GPU run, and device time is scarce.

Each smoke writes to tmp_path (--out and $OUT); none may write into benchmarks/results/ (smoke records are not
measurements)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def results_listing() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()}


def run_smoke(script: str, tmp_path: Path, monkeypatch, *argv: str, expect_rc: int = 0) -> list[dict]:
    """benchmarks/<script>.py's main(["--smoke", *argv]) with $OUT = tmp_path: the JSON documents it wrote."""
    monkeypatch.setenv("OUT", str(tmp_path))
    module = importlib.import_module(f"benchmarks.{script}")
    before = results_listing()
    assert module.main(["--smoke", *argv]) == expect_rc
    assert results_listing() == before, f"{script} --smoke wrote into benchmarks/results/"
    assert not list(tmp_path.glob(".*")), "a partial file was left behind"
    docs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert docs, f"{script} --smoke wrote no JSON"
    for doc in docs:
        assert doc["device"] == "cpu" and doc["command"]
    return docs


def finite_positive(record: dict, *fields: str) -> None:
    for field in fields:
        value = record[field]
        assert isinstance(value, float | int) and math.isfinite(value) and value > 0, (field, record)


def has_fields(record: dict, *fields: str) -> None:
    missing = [f for f in fields if f not in record]
    assert not missing, (missing, record)


def test_bench_kernels(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_kernels", tmp_path, monkeypatch)
    kernels = {r["kernel"] for r in doc["records"]}
    assert {"sparse_decode", "verify", "select_topk"} <= kernels
    for r in doc["records"]:
        assert r["correct"] and r["error"] is None, r
        finite_positive(r, "time_ms")


def test_bench_nsa_kernels(tmp_path, monkeypatch, capsys):
    (doc,) = run_smoke("bench_nsa_kernels", tmp_path, monkeypatch)
    assert doc["failures"] == []
    assert {"nsa-decode", "v0", "v1", "dense-tree", "v0-selected", "v1-selected", "top-n"} == {
        r["kernel"] for r in doc["records"]}
    assert {(r["impl"], r["tree_nodes"]) for r in doc["records"] if r["kernel"] == "top-n"} == {
        (impl, nodes) for impl in ("xla", "pallas", "pallas-packed", "pallas-one-stage")
        for nodes in (1, 4)}
    for r in doc["records"]:
        has_fields(r, "kernel", "tree_nodes", "context", "batch", "bytes", "kernels", "top_kernels")
        finite_positive(r, "time_ms", "wall_ms", "gb_per_s")
        assert r["timer"] == "wall" and r["time_ms"] == r["wall_ms"], r  # no GPU: no kernel clock to read
        assert r.get("max_abs_error", 0) <= 0.05, r  # the script's bf16 tolerance against the twin
    assert doc["complete"] is True
    # The figure's numbers: V0's time over V1's at each measured tree size, the fastest Pallas impl of each.
    module = importlib.import_module("benchmarks.bench_nsa_kernels")
    ((where, points),) = module.v0_over_v1(doc["records"]).items()
    fastest = lambda kernel: min(r["time_ms"] for r in doc["records"]  # noqa: E731
                                 if r["kernel"] == kernel and r["impl"] != "xla")
    assert points == [(4, pytest.approx(fastest("v0") / fastest("v1")), points[0][2])] and where == (512, 1)
    pytest.importorskip("matplotlib")
    (saved,) = tmp_path.glob("nsa-kernels-*.json")
    assert module.main(["--plot", str(saved), str(saved), "--figure", str(tmp_path / "figure.png")]) == 0
    assert (tmp_path / "figure.png").stat().st_size > 0
    # A run at the view's shapes beside it would merge points of different shapes: refused.
    view = json.loads(saved.read_text())
    view["records"] = [r | {"shapes": "smollm2-view"} for r in view["records"]]
    (tmp_path / "view.json").write_text(json.dumps(view))
    assert module.main(["--plot", str(saved), str(tmp_path / "view.json"), "--figure", str(tmp_path / "x.png")]) == 2
    assert "one figure per shapes; these files mix nsa-1b, smollm2-view" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bench_tree_attention(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_tree_attention", tmp_path, monkeypatch)
    assert doc["failures"] == []
    assert {r["impl"] for r in doc["records"]} >= {"pallas", "linear-causal"}
    for r in doc["records"]:
        finite_positive(r, "time_ms", "bytes")
        assert r.get("max_abs_error", 0) <= 1e-2, r


def test_bench_weight_only(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_weight_only", tmp_path, monkeypatch)
    assert {(r["weights"], r["backend"]) for r in doc["records"]} == {
        ("bf16", "xla"), ("int8", "xla"), ("int8", "pallas"), ("int4", "xla"), ("int4", "pallas")}
    for r in doc["records"]:
        assert "error" not in r, r
        finite_positive(r, "ms", "weight_gb_per_s", "weight_bytes")


def test_bench_weight_only_integer_dot(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_weight_only", tmp_path, monkeypatch, "--integer-dot", "--bits", "8,4", "--group", "32",
                       "--x-group", "64")
    measured = {(r["rows"], r["weights"], r["backend"]) for r in doc["records"]}
    # int4 groups of 32 at 4 rows: blocks of 16 code rows, below the int8 dot's K, so no integer variant.
    assert measured == {(1, "bf16", "xla"), (4, "bf16", "xla")} | {
        (rows, f"int{bits}", backend) for rows in (1, 4) for bits in (8, 4)
        for backend in ("xla", "pallas", "pallas-integer") + (("pallas-integer-words",) if rows == 1 else ())
        if (rows, bits, backend) != (4, 4, "pallas-integer")}
    for r in doc["records"]:
        assert "error" not in r, r
        finite_positive(r, "ms", "weight_gb_per_s", "weight_bytes")


def test_bench_weight_only_unpackings_and_split_multiples(tmp_path, monkeypatch, capsys):
    """--nibble-unpack ops,prmt times the int4 dot kernel both ways (prmt in its integer emulation here) and
    --split-factors 1,2 each kernel at its default and twice its K splits, all checked against the reference
    first; bad values of these flags and of --prefetch are one error line."""
    (doc,) = run_smoke("bench_weight_only", tmp_path, monkeypatch, "--bits", "4", "--nibble-unpack", "ops,prmt",
                       "--split-factors", "1,2")
    configs = {r["config"] for r in doc["records"] if r["backend"] == "pallas"}
    assert configs == {"64x64/w4s3", "64x64/w4s3/prmt", "64x64/w4s3/splits2", "64x64/w4s3/prmt/splits2"}
    for r in doc["records"]:
        assert "error" not in r, r
        assert r["weights"] == "bf16" or r["relative_error"] < 0.01, r
    module = importlib.import_module("benchmarks.bench_weight_only")
    for flag, value in (("--nibble-unpack", "ops,lut"), ("--split-factors", "1,0"), ("--split-factors", "x"),
                        ("--prefetch", "2"), ("--prefetch", "auto,yes")):
        assert module.main(["--smoke", flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {flag} {value}:"), err


def test_bench_draft_products(tmp_path, monkeypatch, capsys):
    """The kernel table: every precision in both kernel layouts (the Mosaic GPU kernel and the Triton ones, in
    interpret mode here) beside bf16, each checked against the dequantized product first; bad flags are one error
    line."""
    (doc,) = run_smoke("bench_draft_products", tmp_path, monkeypatch, "--rows", "1,5", "--repeats", "1")
    assert {(r["rows"], r["weights"], r["layout"]) for r in doc["records"]} == {
        (1, "bf16", "xla"), (5, "bf16", "xla")} | {
        (rows, w, layout) for rows in (1, 5) for w in ("int4", "int8") for layout in ("transposed", "bytes")}
    for r in doc["records"]:
        assert "error" not in r, r
        finite_positive(r, "ms", "gb_per_s", "weight_bytes", "of_read_bandwidth")
        assert r["weights"] == "bf16" or (r["kernel_layout"] and r["relative_error"] < 0.02), r
    module = importlib.import_module("benchmarks.bench_draft_products")
    for flag, value in (("--bits", "3"), ("--layouts", "rows"), ("--rows", "0")):
        assert module.main(["--smoke", flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {flag}"), err
    # The tokamax candidate needs the library and a GPU: here it is refused in one line, nothing measured.
    assert module.main(["--smoke", "--tokamax", "--out", str(tmp_path / "tk")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tokamax"), err
    assert not (tmp_path / "tk").exists() or not any((tmp_path / "tk").iterdir())


def test_bench_quantized_gemm(tmp_path, monkeypatch, capsys):
    (doc,) = run_smoke("bench_quantized_gemm", tmp_path, monkeypatch)
    assert doc["complete"] is True
    for r in doc["records"]:
        assert "error" not in r, r
        finite_positive(r, "ms", "gb_per_s", "speedup_vs_bf16")
    native = [r for r in doc["records"] if r["weights"] == "int4 g128 native s4"]
    packed = {(r["shape"], r["rows"]): r for r in doc["records"] if r["weights"] == "int4 g128 grouped"}
    assert native and all(r["weight_bytes"] == packed[r["shape"], r["rows"]]["weight_bytes"] for r in native)
    with pytest.raises(SystemExit) as bad:  # argparse: usage, then one `error:` line naming the flag
        importlib.import_module("benchmarks.bench_quantized_gemm").main(["--smoke", "--kinds", "bf16,int3"])
    assert bad.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --kinds bf16,int3: unknown int3")


def test_native_int4_is_the_same_weight():
    """The benchmark's XLA int4 form of an int4 weight multiplies as the weight's float64 definition."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.bench_quantized_gemm import native_int4, native_int4_product
    from models.quantized import dequantize, quantize_int4

    w = quantize_int4(jax.random.normal(jax.random.key(0), (256, 48)), 128)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    want = x.astype(np.float64) @ np.asarray(dequantize(w), np.float64)
    got = np.asarray(native_int4_product(jnp.asarray(x), native_int4(w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bench_lm_head(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_lm_head", tmp_path, monkeypatch)
    assert {(r["variant"], r["rows"]) for r in doc["records"]} == {
        (v, rows) for v in ("f32-out", "bf16-out", "decoder") for rows in (1, 8)}
    for r in doc["records"]:
        finite_positive(r, "ms", "weight_gb_per_s")
        assert r["max_abs_error"] < 0.05, r  # bf16 inputs, float32 accumulation, against float64


def test_bench_head_context(tmp_path, monkeypatch, capsys):
    """Both heads (without and with the prompt's rows) trained, measured and decoded with; decoding with either is
    the target's greedy decoding; a bad flag is one error line."""
    (doc,) = run_smoke("bench_head_context", tmp_path, monkeypatch)
    assert doc["settings"]["smoke"] and 0 <= doc["target_copies"] <= 1
    assert [h["context_tokens"] for h in doc["heads"]] == [0, doc["settings"]["prompt_tokens"]]
    for h in doc["heads"]:
        assert len(h["agreement_by_depth"]) == doc["settings"]["head"]["unroll"] + 1, h
        assert all(0 <= a <= 1 for a in h["agreement_by_depth"]) and math.isfinite(h["held_out_loss"]), h
        (decoding,) = h["decoding"].values()
        assert decoding["tau"] >= 1 and decoding["identical_to_plain"] == decoding["sequences"], h
    module = importlib.import_module("benchmarks.bench_head_context")
    for flag, value in (("--head-steps", "0"), ("--prompts", "7"), ("--prompt-tokens", "20")):
        assert module.main([flag, value, "--out", str(tmp_path / "none")]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {flag} {value}: must be >= "), line


def test_bench_draft_precision(tmp_path, monkeypatch):
    assert len(run_smoke("bench_draft_precision", tmp_path, monkeypatch, "--precisions", "bf16,int8,int4-a8")) == 2
    # The names carry the time each part began (the real part first), then the part.
    random, real = (json.loads(next(tmp_path.glob(f"draft-precision-*-{part}.json")).read_text())
                    for part in ("random", "real"))
    assert real["records"][0]["model"].startswith("tiny (random weights, smoke)")
    for doc in (real, random):
        assert doc["complete"] is True
        assert [(r["precision"], r["draft_weights"], r["draft_activations"]) for r in doc["records"]] == [
            ("bf16", "bf16", "bf16"), ("int8", "int8", "bf16"), ("int4-a8", "int4", "int8")]
        for r in doc["records"]:
            finite_positive(r, "ms_per_iteration", "plain_ms_per_step", "draft_ms_per_step")
    for r in real["records"]:
        assert r["identical_to_plain"] == [True] * r["batch"], r  # greedy Vegas is plain decoding
        assert 1 <= r["tau"] <= r["gamma"] + 1
    for r in random["records"]:
        finite_positive(r, "verify_ms", "select_ms")
        assert r["projection"]["tau"] == next(q["tau"] for q in real["records"] if q["precision"] == r["precision"])


def test_measure_approx_modes(tmp_path, monkeypatch, capsys):
    (doc,) = run_smoke("measure_approx_modes", tmp_path, monkeypatch, "--out", str(tmp_path))
    assert doc["complete"] is True
    (record,) = doc["modes"]
    assert record["mode"] == "s2w1r2"
    assert 0 <= record["top1_agreement"] <= 1 and 0 <= record["greedy_agreement"] <= 1
    finite_positive(record, "perplexity", "perplexity_exact")
    assert record["scored_tokens"] == doc["new_tokens"] and record["greedy_equal_prefix"][0] <= doc["new_tokens"]
    # progress: a line per text as it is scored, for the exact target and for the mode
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if ": text " in line] == [
        "exact", "s2w1r2"]


def test_profile_ssv(tmp_path, monkeypatch):
    (doc,) = run_smoke("profile_ssv", tmp_path, monkeypatch)
    from vegas_jax.ssv.planner import PROFILE_FORMAT

    assert doc["format"] == PROFILE_FORMAT and doc["complete"] is True  # saved after every record, then complete
    assert {r["kernel"] for r in doc["kernels"]} == {
        "linear", "nsa-decode", "refresh-decode", "reuse-decode", "tree", "tree-refresh", "tree-reuse"}
    from vegas_jax.attention.nsa_tree import TREE_SCHEDULE

    # Timed with the schedule the loop verifies with, which the planner's passes then cost.
    assert {r["schedule"] for r in doc["kernels"] if r["kernel"].startswith("tree")} == {TREE_SCHEDULE}
    for table in ("kernels", "passes", "drafts"):
        for r in doc[table]:
            finite_positive(r, "ms")
    assert {r["mode"] for r in doc["passes"]} == {"exact", "s2w1r2"}
    assert {r["drafter"] for r in doc["drafts"]} == {"ngram", "self", "head"}  # the planner costs each drafter's trees
    assert {r["window"] for r in doc["drafts"] if r["drafter"] == "head"} == {64}  # timed over its window
    # A dense model: its passes measured whole, the drafts of the drafters that need no KV selection; the planner
    # takes it for a dense model.
    (dense,) = run_smoke("profile_ssv", tmp_path / "dense", monkeypatch, "--model", "tiny-dense")
    assert dense["config"]["attention"] == "dense" and not dense["kernels"]
    assert {(r["mode"], r["rows"], r["source"]) for r in dense["passes"]} == {("exact", 1, "measured"),
                                                                              ("exact", 7, "measured")}
    assert {r["drafter"] for r in dense["drafts"]} == {"ngram", "head"}
    for r in dense["passes"] + dense["drafts"]:
        finite_positive(r, "ms")
    assert all(c["relative_error"] <= 1e-4 for c in doc["fused_kernel_checks"])


def test_bench_ssv(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_ssv", tmp_path, monkeypatch, "--out", str(tmp_path))
    assert doc["complete"] is True
    records = doc["records"]
    assert [(r["part"], r["method"], r["precision"]) for r in records] == [
        (part, method, precision) for part in ("view", "nsa-1b")
        for method, precision in (("nsa-ar", "exact"), ("ssv", "exact"), ("ssv", "approximate"))]
    for r in records:
        has_fields(r, "drafter", "approx_mode", "tree", "batch", "prompt_tokens", "decode_tokens_per_s",
                   "speedup_vs_ar", "tau", "ms_per_iteration", "breakdown")
        finite_positive(r, "decode_tokens_per_s", "speedup_vs_ar", "tau", "ms_per_iteration")
        if r["method"] == "ssv":
            finite_positive(r["breakdown"], "draft_ms", "verify_ms")
    assert 0 <= records[2]["greedy_agreement"] <= 1
    assert [r["projection"] for r in records[3:]] == [False, True, True]


def test_bench_ssv_refuses_an_unknown_class_in_one_line(tmp_path, capsys):
    from benchmarks import bench_ssv

    with pytest.raises(SystemExit) as stop:
        bench_ssv.main(["--classes", "exact,fast", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and "--classes: comma-separated, of exact, approximate; got 'exact,fast'" in err[-1]


def test_record_log_saves_every_record_whole(tmp_path, monkeypatch):
    """A run stopped after any record leaves a document with every record so far, marked incomplete."""
    from benchmarks.results_io import RecordLog

    monkeypatch.delenv("OUT", raising=False)
    log = RecordLog({"device": "cpu"}, "r.json", tmp_path, None, key="modes")
    read = lambda: json.loads((tmp_path / "r.json").read_text())  # noqa: E731
    for i in range(3):
        log.add({"i": i})
        assert read() == {"device": "cpu", "modes": [{"i": j} for j in range(i + 1)], "complete": False}
    log.finish()
    assert read()["complete"] is True and len(read()["modes"]) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the temporary file was renamed, not left



OUT_FLAGS = {"bench_call_overhead": "--out", "bench_compile": "--out", "bench_decode": "--out",
             "bench_draft_precision": "--out", "bench_draft_products": "--out", "bench_head_context": "--out",
             "bench_hf_generate": "--out", "bench_lm_head": "--out", "bench_loading": "--out", "bench_mesh": "--out",
             "bench_prefill": "--out",
             "bench_quantized_gemm": "--out", "bench_ssv": "--out", "bench_step_overhead": "--out",
             "bench_weight_only": "--out", "check_planner": "--out", "measure_approx_modes": "--out",
             "profile_decode": "--out", "simulate_adaptive_gamma": "--results", "check_lossless_gpu": "--results"}
REQUIRED = {"check_planner": ["--ssv-profile", "unread.json"], "bench_hf_generate": ["--model", "unread"]}


@pytest.mark.parametrize("flags, line", [
    (["--drafter", "head"], "error: --drafter head and --draft-head go together"),
    (["--draft-head", "random"], "error: --drafter head and --draft-head go together"),
    (["--drafter", "head", "--draft-head", "MISSING"], "error: --draft-head MISSING: no such folder"),
    (["--draft-vocab", "8"], "error: --draft-vocab: only with --draft-head"),
])
def test_profile_decode_refuses_a_bad_draft_head_in_one_line(flags, line, tmp_path, capsys):
    """argparse's usage, then one `error:` line naming the flag; a head folder that is not there is refused before
    anything compiles (it was a traceback)."""
    missing = str(tmp_path / "missing")
    flags = [missing if f == "MISSING" else f for f in flags]
    with pytest.raises(SystemExit) as bad:
        importlib.import_module("benchmarks.profile_decode").main(
            ["--attention", "nsa-view", "--methods", "ssv", "--batch", "1", "--prompt-tokens", "64", *flags])
    assert bad.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(line.replace("MISSING", missing))


@pytest.mark.parametrize("script, flags", [("bench_ssv", ["--drafters", "head"]), ("bench_decode", [])])
def test_a_draft_head_folder_that_is_not_there_is_one_line(script, flags, tmp_path, capsys):
    """As profile_decode's: the folder named in one `error:` line after the model loads, before anything compiles
    (it was a traceback)."""
    missing = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as bad:
        importlib.import_module(f"benchmarks.{script}").main([*flags, "--draft-head", missing, "--out", str(tmp_path)])
    assert bad.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: --draft-head {missing}: no such folder")


@pytest.mark.parametrize("script", OUT_FLAGS)
def test_an_unwritable_results_folder_is_one_line_before_measuring(script, tmp_path, monkeypatch, capsys):
    """A folder that cannot be made (its parent is a file: a read-only folder is no test as root) is refused
    before anything is measured, naming the flag; so is an unwritable $OUT. (simulate_adaptive_gamma used to
    simulate for 20 s, then end in a NotADirectoryError traceback.)"""
    monkeypatch.delenv("OUT", raising=False)
    (tmp_path / "file").write_text("")
    flag, bad = OUT_FLAGS[script], tmp_path / "file" / "sub"
    if script == "bench_hf_generate":
        pytest.importorskip("torch")
    module, required = importlib.import_module(f"benchmarks.{script}"), REQUIRED.get(script, [])
    with pytest.raises(SystemExit) as exit_:
        module.main([*required, flag, str(bad / "r.json" if script == "check_lossless_gpu" else bad)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {flag} {bad}: cannot write results there (Not a directory)\n"
    monkeypatch.setenv("OUT", str(bad))
    with pytest.raises(SystemExit):
        module.main([*required, flag, str(tmp_path / "ok" / ("r.json" if script == "check_lossless_gpu" else ""))])
    assert capsys.readouterr().err == f"error: $OUT {bad}: cannot write results there (Not a directory)\n"
    assert not list((tmp_path / "ok").iterdir())  # the test write left nothing


def test_check_planner(tmp_path, monkeypatch):
    """The planner's run first, then every candidate it weighs; the summary compares them. No run starts past the
    budget (0 s: none at all); --resume finishes a check, rerunning only what its file lacks, and refuses a file
    made with other arguments; a plan two classes share runs once; --measured reuses another profile's check. The profile is made up for the tiny view (what profile_ssv would measure there is
    tested above): the tree is predicted cheaper per token than plain decoding, so the planner chooses it."""
    points = [(batch, context) for batch in (1, 2) for context in (64, 128)]
    passes = [{"mode": mode, "rows": rows, "batch": b, "context": c, "ms": ms * (1 + 0.01 * b * c / 64)}
              for mode in ("exact", "s2w1r2") for rows, ms in ((1, 1.0), (2, 1.1)) for b, c in points]
    drafts = [{"drafter": "self", "nodes": 1, "batch": b, "context": c, "ms": 0.3} for b, c in points]
    profile = tmp_path / "profile" / "tiny.json"
    profile.parent.mkdir()
    profile.write_text(json.dumps({"format": "vegas-ssv-profile", "version": 1, "device": "cpu", "passes": passes,
                                   "drafts": drafts, "distances": {"s2w1r2": {"top1_disagreement": 0.01}}}))
    argv = ("--ssv-profile", str(profile), "--batch", "2", "--context", "102", "--max-new-tokens", "6",
            "--repeats", "1")
    (stopped,) = run_smoke("check_planner", tmp_path, monkeypatch, *argv, "--budget-s", "0")
    assert stopped["complete"] is False
    summaries = stopped["records"]
    assert [(s["kind"], s["planner_measured"], s["measured"], s["left_by_budget"], s["candidates"])
            for s in summaries] == [("summary", False, 0, 2, 2), ("summary", False, 0, 4, 4)]
    assert all(s["best"] is None and s["met"] is None and s["chosen"] == "exact 1x1" for s in summaries)
    (path,) = tmp_path.glob("planner-check-*.json")
    with pytest.raises(SystemExit, match="other arguments"):
        importlib.import_module("benchmarks.check_planner").main(
            ["--smoke", *argv[:3], "3", *argv[4:], "--resume", str(path)])

    (doc,) = run_smoke("check_planner", tmp_path, monkeypatch, *argv, "--resume", str(path))
    assert doc["complete"] is True
    by_kind = {kind: [r for r in doc["records"] if r["kind"] == kind] for kind in ("candidate", "planner", "summary")}
    assert [r["label"] for r in by_kind["planner"]] == ["exact 1x1", "exact 1x1"]  # both classes choose the tree
    labels = [r["label"] for r in by_kind["candidate"]]
    assert sorted(labels) == sorted(["exact plain", "exact 1x1", "exact plain", "exact 1x1",
                                     "s2w1r2 plain", "s2w1r2 1x1"])
    # The approximate class's exact plans are the exact class's runs, filed again, not run again.
    by_plan = {(r["precision"], r["label"]): r for r in by_kind["candidate"]}
    for plan in ("exact plain", "exact 1x1"):
        again = by_plan[("approximate", plan)]
        assert again["measured_as"] == "exact" and "measured_as" not in by_plan[("exact", plan)]
        assert again["decode_tokens_per_s"] == by_plan[("exact", plan)]["decode_tokens_per_s"]
    assert [r.get("measured_as") for r in by_kind["planner"]] == [None, None]  # the classes weigh other grids
    for r in by_kind["candidate"] + by_kind["planner"]:
        finite_positive(r, "decode_tokens_per_s", "predicted_ms_per_token", "tau")
    assert len(by_kind["summary"]) == 2
    for summary in by_kind["summary"]:
        assert summary["measured"] == summary["candidates"] and summary["left_by_budget"] == 0
        best = max(r["decode_tokens_per_s"] for r in by_kind["candidate"] if r["precision"] == summary["precision"])
        assert summary["best_tokens_per_s"] == best
        assert summary["met"] == (summary["chosen_over_best"] >= 0.9)

    # A check that lost its last record (a call ended mid-run): only that one runs again.
    kept = [r for r in doc["records"] if r["kind"] != "summary"][:-1]
    path.write_text(json.dumps({**doc, "records": kept, "complete": False}))
    (resumed,) = run_smoke("check_planner", tmp_path, monkeypatch, *argv, "--resume", str(path))
    runs = [r for r in resumed["records"] if r["kind"] != "summary"]
    assert resumed["complete"] is True and runs[:-1] == kept and len(runs) == len(kept) + 1

    # Another profile (plain decoding now predicted cheaper) reuses every candidate run: only the planner runs.
    slow = tmp_path / "profile" / "slow-drafts.json"
    slow.write_text(json.dumps({**json.loads(profile.read_text()),
                                "drafts": [{**d, "ms": 50.0} for d in drafts]}))
    other = ("--ssv-profile", str(slow), *argv[2:])
    path = path.rename(tmp_path / "profile" / path.name)  # out of $OUT, where the new check writes
    (again,) = run_smoke("check_planner", tmp_path, monkeypatch, *other, "--measured", str(path), "--budget-s", "0")
    fresh = [r for r in again["records"] if r["kind"] != "summary" and "measured_in" not in r]
    assert fresh == []  # a budget of 0 s runs nothing, yet every candidate is there
    assert all(s["measured"] == s["candidates"] and not s["planner_measured"] and s["chosen"].endswith("plain")
               for s in again["records"] if s["kind"] == "summary")
    reused = {(r["precision"], r["label"]): r for r in again["records"] if r["kind"] == "candidate"}
    assert reused[("exact", "exact 1x1")]["predicted_ms_per_token"] > by_plan[("exact", "exact 1x1")][
        "predicted_ms_per_token"]
    with pytest.raises(SystemExit, match="--measured .*other arguments"):
        importlib.import_module("benchmarks.check_planner").main(
            ["--smoke", *other[:3], "3", *other[4:], "--measured", str(path)])


def test_bench_mesh(tmp_path):
    """On two CPU devices (its own process: the suite's sees one): one device, model=2 and data=2 timed, the
    score reduction timed where there is a model axis, data=2's greedy Vegas equal to one device's; a mesh that
    does not cover the devices is one error line naming --meshes."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", OUT="")
    script = [sys.executable, str(RESULTS.parent / "bench_mesh.py")]
    bad = subprocess.run([*script, "--meshes", "data=4"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --meshes: mesh data=4,model=1: 4 devices, but 2 are available (cpu)"]
    run = subprocess.run([*script, "--smoke", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (saved,) = tmp_path.glob("mesh-*-smoke.json")
    doc = json.loads(saved.read_text())
    assert doc["complete"] is True and doc["devices"] == 2 and doc["device"] == "cpu"
    timing = [r for r in doc["records"] if r["part"] == "timing"]
    assert {(r["mesh"], r["method"]) for r in timing} == {(m, k) for m in ("one", "model=2", "data=2")
                                                         for k in ("ar", "vegas")}
    for r in timing:
        has_fields(r, "mesh", "gpus", "model", "batch", "context", "method", "projected")
        finite_positive(r, "ms_per_iteration", "plain_ms_per_step", "decode_tokens_per_s", "planned_bytes_per_gpu")
        assert r["projected"] == (r["method"] == "vegas") and r["gpus"] == (1 if r["mesh"] == "one" else 2)
        assert (r["speedup_vs_one_gpu"] is None) == (r["mesh"] == "one")
        assert ("score_reduction_ms" in r) == (r["method"] == "vegas")
        assert (r.get("score_reduction_ms", 0) > 0) == (r["mesh"] == "model=2" and r["method"] == "vegas")
    (identity,) = [r for r in doc["records"] if r["part"] == "identity"]
    assert identity["mesh"] == "data=2" and identity["identical"] == [True] * identity["batch"]
    # Past its budget it starts nothing more and says the document is incomplete.
    cut = subprocess.run([*script, "--smoke", "--budget-s", "0", "--out", str(tmp_path / "cut")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert cut.returncode == 0, cut.stderr[-3000:]
    (saved,) = (tmp_path / "cut").glob("mesh-*-smoke.json")
    assert json.loads(saved.read_text()) | {"date": None, "command": None} == {
        **doc, "records": [], "complete": False, "date": None, "command": None}


def test_bench_compile(tmp_path, monkeypatch):
    (doc,) = run_smoke("bench_compile", tmp_path, monkeypatch)
    assert [r["how"] for r in doc["records"]] == ["first", "serial", "2 threads"] and doc["complete"]
    for r in doc["records"]:
        finite_positive(r, "wall_s", "lower_s", "compile_s")
        programs = {p["program"] for p in r["programs"]}
        assert "decode" in programs and "bootstrap" in programs, programs
    assert "prefill_chunk" in {p["program"] for p in doc["records"][0]["programs"]}  # compiled once, first


def test_check_lossless_gpu(tmp_path, monkeypatch, capsys):
    (doc,) = run_smoke("check_lossless_gpu", tmp_path, monkeypatch)
    assert doc["complete"] and doc["missed"] == [] and doc["not_run"] == []
    by_part = {}
    for r in doc["records"]:
        assert "error" not in r, r
        by_part.setdefault(r["part"], []).append(r)
    assert {r["case"] for r in by_part["float32"]} == {"vegas", "ssv-ngram", "plain@1 vs plain@2"}
    for r in by_part["float32"] + by_part["bf16"]:
        has_fields(r, "batch", "sequences", "identical", "divergences")
    for r in by_part["float32"]:
        assert r["identical"] == r["sequences"], r  # float32 on the CPU: Vegas and SSV are plain decoding
    assert {r["case"] for r in by_part["bf16"]} == {"plain@1 vs plain@2", "vegas@1 vs plain@1",
                                                    "streaming@1 vs plain@1", "vegas@2 vs plain@2",
                                                    "streaming@2 vs plain@2"}
    assert {(r["method"], r["dtype"], r["dot_precision"]) for r in by_part["cost"]} == {
        (m, d, p) for m in ("ar", "vegas") for d, p in (("float32", "highest"), ("float32", "jax-default"),
                                                        ("bfloat16", "jax-default"))}
    for r in by_part["cost"]:
        finite_positive(r, "decode_tokens_per_s")
    assert {r["case"] for r in by_part["sampled"]} == {"vegas", "tree-self"}
    for r in by_part["sampled"]:
        assert 0 <= r["p_value"] <= 1 and r["seeds"] == 400, r
    out = capsys.readouterr().out
    assert "every target met" in out and "float32 noise floor" in out
    # Past the budget no case starts; the document says which did not run and that it is incomplete.
    (cut,) = run_smoke("check_lossless_gpu", tmp_path / "cut", monkeypatch, "--parts", "float32", "--budget-s", "0")
    assert not cut["complete"] and not cut["records"]
    assert cut["not_run"] == ["float32 plain (dense) at batch 1", "float32 plain (nsa-view) at batch 1",
                              "float32 plain (dense) at batch 2", "float32 plain (nsa-view) at batch 2"]


def test_check_lossless_gpu_judges_divergences(capsys):
    """A divergence is a near-tie when the token taken is among plain decoding's candidates there with a gap to the
    best within twice the noise floor (a third choice too); its position and margin are plain decoding's there; the
    noise floor is the largest difference of an agreed token's log-probability between two runs; a bad flag is one
    error line."""
    from benchmarks import check_lossless_gpu as check
    from vegas_jax.decode.logprobs import TokenLogprob
    from vegas_jax.runtime.results import RequestResult

    def request(tokens, top2=None, third=None):
        """top2: per token (second choice, -log p of the token, -log p of the second choice); third: a third
        candidate (token, -log p) at every position."""
        logprobs = None if top2 is None else [TokenLogprob(t, -a, [(t, -a), (u, -b)] + ([] if third is None else
                                                                                      [(third[0], -third[1])]))
                                              for t, (u, a, b) in zip(tokens, top2)]
        return RequestResult(3, tokens, "", {}, "ok", None, logprobs)

    tops = [[(1, 0.1, 0.12), (9, 0.2, 1.2), (8, 0.3, 0.31)], [(1, 0.1, 2.0), (9, 0.2, 1.2), (8, 0.3, 2.3)],
            [(1, 0.1, 2.0), (9, 0.2, 1.2)], [(1, 0.1, 2.0), (9, 0.2, 0.205)], [(1, 0.1, 2.0), (9, 0.2, 0.205)]]
    plain = [request([5, 6, 7], tops[0]), request([5, 6, 7], tops[1]), request([5, 6], tops[2]),
             request([5, 6], tops[3], third=(3, 0.212)), request([5, 6], tops[4], third=(3, 0.5))]
    other = [request([5, 6, 8]), request([5, 4, 7]), request([5, 6]), request([5, 3]), request([5, 3])]
    result = check.judge(check.compare(other, plain), noise=0.01)
    assert (result["sequences"], result["identical"], result["rounding"]) == (5, 1, None)
    tie, bug, third, far_third = result["divergences"]
    assert (tie["sequence"], tie["position"], tie["token"], tie["reference_token"]) == (0, 2, 8, 7)
    assert tie["margin"] == pytest.approx(0.01) and tie["rank"] == 1 and tie["near_tie"]
    assert (bug["sequence"], bug["position"], bug["margin"]) == (1, 1, pytest.approx(1.0))
    assert bug["rank"] is None and bug["gap"] is None and bug["near_tie"] is False
    # Plain decoding's third choice within rounding of its best is a near-tie; beyond it, a bug.
    assert third["rank"] == 2 and third["gap"] == pytest.approx(0.012) and third["near_tie"]
    assert far_third["rank"] == 2 and far_third["gap"] == pytest.approx(0.3) and far_third["near_tie"] is False
    assert check.judge(check.compare(other, plain), noise=None)["divergences"][0]["near_tie"] is None
    shifted = [request(r.tokens, [(u, a + 1e-3 * (i + 1), b) for i, (u, a, b) in enumerate(top)])
               for r, top in zip(plain, tops)]
    # Differs at its third token, whose log-probability is not rounding's to count.
    shifted[0] = request([5, 6, 8], [(u, a + d, b) for (u, a, b), d in zip(tops[0], (1e-3, 2e-3, 1.0))])
    assert check.compare(shifted, plain)["rounding"] == pytest.approx(3e-3)  # the agreed tokens only
    # Targets: float32 identity of every speculative case, self-drafted chains' drafts accepted (their rate: adaptive
    # γ's τ 1.80 of one-token drafts is healthy); bf16 identity no worse than plain against plain, every divergence a
    # near-tie. Plain against plain is the yardstick, never a miss.
    records = [{"part": "float32", "case": "plain@1 vs plain@8", "batch": 8, "identical": 1, "sequences": 2},
               {"part": "float32", "case": "vegas", "batch": 8, "identical": 1, "sequences": 2, "tau": 6.0,
                "acceptance_rate": 0.83},
               {"part": "float32", "case": "vegas-int4-a8", "batch": 8, "identical": 2, "sequences": 2, "tau": 1.0,
                "acceptance_rate": 0.0},
               {"part": "float32", "case": "vegas-auto", "batch": 1, "identical": 2, "sequences": 2, "tau": 1.8,
                "acceptance_rate": 0.8},
               {"part": "float32", "case": "tree-ngram", "batch": 8, "identical": 2, "sequences": 2, "tau": 1.2,
                "acceptance_rate": 0.1},
               {"part": "bf16", "case": "plain@1 vs plain@8", "identical": 6, "sequences": 8,
                "divergences": [{"near_tie": False}] * 2},
               {"part": "bf16", "case": "vegas@8 vs plain@8", "identical": 5, "sequences": 8,
                "divergences": [{"near_tie": True}] * 3},
               {"part": "bf16", "case": "streaming@8 vs plain@8", "identical": 7, "sequences": 8,
                "divergences": [{"near_tie": False}]},
               {"part": "sampled", "case": "quest", "passed": False, "p_value": 1e-9}]
    rejected = "float32 vegas-int4-a8 at batch 8: acceptance rate 0.00 (τ 1.00), drafts rejected"
    assert check.verdict(records) == ["float32 vegas at batch 8: 1/2 identical", rejected,
                                      "bf16 streaming@8 vs plain@8: a divergence beyond rounding",
                                      "sampled quest: p = 1.00e-09",
                                      "bf16 vegas@8 vs plain@8: identity 5/8 below plain-vs-plain's 75%"]
    for flags, needle in [(["--parts", "fp8"], "--parts: unknown 'fp8'"), (["--batches", "8,x"], "--batches"),
                          (["--cases", "eagle"], "--cases: unknown 'eagle'")]:
        assert check.main(flags) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and needle in line


def test_bench_first_token_times_the_first_byte_of_stdout(tmp_path, monkeypatch):
    """bench_first_token times the README's generate command (found without its `make install &&`) from start to
    the first byte of its stdout, the generated text; here a stand-in that writes its log to stderr, waits, then
    writes text, and reports the CLI's summary line; a failing command is reported and fails the script."""
    import shlex
    import sys

    from benchmarks import bench_first_token

    command = bench_first_token.readme_command()
    assert "-m vegas_jax.generate" in command and "make install" not in command
    script = ("import sys, time; print('loaded', file=sys.stderr, flush=True); time.sleep(0.5); "
              "sys.stdout.write('The'); sys.stdout.flush(); time.sleep(0.5); "
              "print('[vegas] compile 1.50s  prefill 2.00s  decode 3.00s  4.0 tok/s', file=sys.stderr)")
    stand_in = f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench_first_token.main(["--runs", "cold,warm", "--command", stand_in, "--out", str(tmp_path)]) == 0
    (doc,) = [json.loads(p.read_text()) for p in tmp_path.glob("first-token-*.json")]
    assert doc["complete"] and [r["run"] for r in doc["records"]] == ["cold", "warm"]
    for record in doc["records"]:
        assert 0.5 <= record["first_token_s"] < record["end_s"] and record["end_s"] >= 1.0
        assert record["exit_status"] == 0 and record["first_token_within_target"]
        assert record["methods"] == {"vegas": {"compile_s": 1.5, "prefill_s": 2.0, "decode_s": 3.0}}
    assert bench_first_token.main(["--runs", "cold", "--command", "exit 3", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("runs", ["hot", "cold,warm,warm", ","])
def test_bench_first_token_refuses_bad_runs(runs, capsys):
    from benchmarks import bench_first_token

    with pytest.raises(SystemExit) as bad:  # argparse: usage, then one `error:` line naming the flag
        bench_first_token.main(["--runs", runs, "--command", "true"])
    assert bad.value.code == 2
    assert "error: --runs: comma-separated, of cold, warm" in capsys.readouterr().err.splitlines()[-1]
