"""The documentation cannot drift from the code and the results: docs/cli.md is what the CLI's parsers generate, and
the generated blocks of README.md, docs/benchmarks.md and docs/nsa-ssv.md are what `python -m benchmarks.report`
writes from the records committed in benchmarks/results/ (after a new record: run it, as the blocks say)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402
from benchmarks.suite_records import latest_per_key, read_logs  # noqa: E402
from vegas_jax import cli_reference  # noqa: E402


def test_cli_reference_is_what_the_parsers_generate():
    assert (REPO / "docs" / "cli.md").read_text() == cli_reference.render(), \
        "docs/cli.md is stale: run python -m vegas_jax.cli_reference"


def test_cli_reference_lists_every_flag_with_its_variable():
    from vegas_jax import generate, score

    text = cli_reference.render()
    for module in (generate, score):
        for action in module.build_parser()._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in text or flag in ("-h", "--help")
    assert "| `--max-new-tokens` | N (K, M suffixes) | `256` |" in text and "`VEGAS_MAX_NEW_TOKENS` |" in text
    assert "| `--stop` | TEXT (repeatable) | - |" in text  # no variable for a repeatable flag
    assert "| `--pairs` | PATH | required |" in text


def _committed_records():
    return latest_per_key(report.one_preset_per_row(read_logs(sorted(report.RESULTS.glob("suite-*.jsonl")))))


def test_the_generated_blocks_are_the_reports_output_from_the_committed_results():
    records = _committed_records()
    legacy = report.load_legacy(report.RESULTS, report.LEGACY_THROUGHPUT + report.LEGACY_POLICIES
                                + report.LEGACY_SERVE + report.LEGACY_PEER)
    plots = {name: report.RESULTS / f"suite-{name}.png" for name in ("throughput", "acceptance", "iteration-time",
                                                                       "roofline")}
    assert all(path.exists() for path in plots.values())
    readme, benchmarks, nsa = (path.read_text() for path in (report.README, report.BENCHMARKS_DOC, report.NSA_DOC))
    stale = "stale: run python -m benchmarks.report"
    assert report.splice(benchmarks, report.section(records, legacy, plots)) == benchmarks, stale
    assert report.splice(nsa, report.nsa_kernel_block(report.RESULTS), report.NSA_BEGIN, report.NSA_END) == nsa, stale
    headline = report.headline(records, plots["throughput"])
    assert report.splice(readme, headline, report.HEADLINE_BEGIN, report.HEADLINE_END) == readme, stale


def test_the_headline_is_one_table_of_the_longest_prompts():
    def held(method, length, rate):
        return {"stage": "heldout", "split": "heldout", "method": method, "batch": 8, "prompt_tokens": length,
                "temperature": 0.0, "tuned": True, "default": method == "ar", "repeats": 3, "tau": 4.0,
                "decode_tokens_per_s": rate, "decode_tokens_per_s_min": rate, "decode_tokens_per_s_max": rate,
                "gamma": 4, "sparse_ratio": 0.05, "knobs": {}, "tuned_at_batch": 8, "date": "2026-12-02T00:00:00",
                "device": "NVIDIA H200", "jax_version": "0.11.2", "dtype": "bfloat16", "code": "abc1234",
                "model": "/x/smollm2.gguf",
                "log": "suite-paper"}

    records = [held("ar", 7936, 1000), held("vegas", 7936, 1500), held("ar", 2048, 2000), held("vegas", 2048, 2100)]
    text = report.headline(records, report.RESULTS / "suite-throughput.png")
    assert text.startswith(report.HEADLINE_BEGIN) and text.endswith(report.HEADLINE_END)
    assert ("NVIDIA H200, jax 0.11.2, bfloat16, model smollm2.gguf, code abc1234, 2026-12-02; logs "
            "`suite-paper.jsonl`.") in text
    assert "7936-token prompts" in text and "2048" not in text and "| 8 | 1,000 (1,000-1,000) | 1,500" in text
    assert "![throughput](benchmarks/results/suite-throughput.png)" in text
    assert "**not yet measured**" in report.headline([], None)


def test_docs_links_resolve():
    """Every relative link of the README and docs/ names a file that exists."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links {target}, which does not exist"
