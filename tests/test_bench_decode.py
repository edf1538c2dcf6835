"""benchmarks/bench_decode.py's comparison of a method's greedy output with plain decoding's, its runs, and its
refusal of a bad flag."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_decode import first_differences, is_plain, main, runs


def test_first_differences_per_sequence():
    plain = [np.array([5, 6, 7, 8]), np.array([1, 2, 3]), np.array([9, 9]), np.array([4, 4, 4]), np.array([], int)]
    other = [np.array([5, 6, 7, 8]), np.array([1, 0, 3]), np.array([9, 9, 2]), np.array([4, 4]), np.array([], int)]
    # identical; differs at 1 (a later match does not undo it); runs longer (differs where plain stopped);
    # stops early; both empty.
    assert first_differences(other, plain) == [None, 1, 2, 2, None]


def test_first_difference_is_the_earliest_mismatch():
    rng = np.random.default_rng(0)
    for _ in range(50):
        plain = rng.integers(0, 3, size=rng.integers(1, 12))
        other = plain.copy()
        changed = rng.integers(0, len(plain))
        other[changed:] = (other[changed:] + rng.integers(0, 2, size=len(plain) - changed)) % 3
        want = next((i for i in range(len(plain)) if other[i] != plain[i]), None)
        assert first_differences([other], [plain]) == [want]


def test_plain_decoding_is_the_baseline_of_every_tree():
    """The head's and n-gram drafter's trees run method ar: they are compared with plain decoding, not taken for it
    (they once replaced the baseline, and a head's speedup read 1.00)."""
    specs = runs("ar,vegas", "head:6x1,ngram:4x2,self:6x1", "vegas")
    assert [(m, t, d) for m, t, d in specs] == [("ar", None, "self"), ("vegas", None, "self"), ("ar", "6x1", "head"),
                                                ("ar", "4x2", "ngram"), ("vegas", "6x1", "self")]
    assert [is_plain(m, t) for m, t, _ in specs] == [True, False, False, False, False]


@pytest.mark.parametrize("windows", ["trained,wide", "0,-5"])
def test_a_bad_head_window_is_one_error_line(capsys, windows):
    with pytest.raises(SystemExit) as exit_info:
        main(["--head-windows", windows, "--out", "/tmp"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --head-windows" in error and repr(windows) in error, error


def test_rates_shape_the_trees_they_name_and_nothing_else(capsys, tmp_path):
    """--tree-rates reach the NODES[dDEPTH] trees of --trees (recorded with their size and depth); given with none,
    they are refused in one line."""
    import json
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    common = ["--model", str(fixture), "--dtype", "float32", "--batches", "1", "--prompt-tokens", "40",
              "--max-new-tokens", "8", "--methods", "ar", "--repeats", "1", "--out", str(tmp_path)]
    assert main([*common, "--trees", "ngram:5d2", "--tree-rates", "0.6,0.3"]) in (0, None)
    (path,) = tmp_path.glob("e2e-*.json")
    shaped = [r for r in json.loads(path.read_text())["records"] if r["draft_tree"] == "5d2"]
    assert len(shaped) == 1 and (shaped[0]["tree_nodes"], shaped[0]["tree_depth"]) == (5, 2)
    assert tuple(shaped[0]["tree_rates"]) == (0.6, 0.3)
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--trees", "ngram:4x2", "--tree-rates", "0.6,0.3"])
    assert exit_info.value.code == 2
    assert "error: --tree-rates: only with a NODES[dDEPTH] tree" in capsys.readouterr().err.strip().splitlines()[-1]
