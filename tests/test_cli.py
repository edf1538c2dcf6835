"""`python -m vegas_jax.generate` on the tiny Llama fixture: bad input gives one `error:` line naming the flag or
file at fault; --output-json, --compare-ar, batches, prompt files, --no-chat-template, --stream and an Orbax copy
from `vegas_jax.convert` all report the tokens the library API produces."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from vegas_jax import convert, generate, score
from vegas_jax.runtime import compilation
from vegas_jax.cli import flag_environment
from vegas_jax.runtime import scoring
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError
from vegas_jax.loading import load_model

REPO = Path(__file__).parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "tiny-llama"
PROMPT = "The quick brown fox"
MAX_NEW = 24
# --max-model-len 128 keeps every compiled cache small; --quiet keeps progress bars off even on a terminal.
COMMON = ["--dtype", "float32", "--max-model-len", "128", "--quiet"]
BASE = ["--model", str(FIXTURE), *COMMON, "--max-new-tokens", str(MAX_NEW)]
# A sparse draft that this random model's target accepts at some positions and rejects at others (acceptance
# about 0.4): identity with plain decoding then depends on the verification, not on a draft that never differs.
VEGAS = ["--method", "vegas", "--gamma", "3", "--sparse-ratio", "0.9", "--min-sparse-tokens", "4"]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """main() in-process, for module-scoped fixtures (capsys is per test); sys.stdout/err are looked up per write."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = generate.main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_json(capsys, tmp_path: Path, argv: list[str]) -> tuple[dict, str, str]:
    path = tmp_path / "out.json"
    rc = generate.main([*argv, "--output-json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(path.read_text()), out, err


@pytest.fixture(scope="module")
def reference():
    """The library API on the same model and prompt: plain greedy decoding, no CLI involved."""
    engine = Engine(load_model(str(FIXTURE), jnp.float32))
    result = engine.generate([PROMPT], GenerationOptions(max_new_tokens=MAX_NEW, max_model_len=128))
    return engine, result.requests[0]


@pytest.fixture(scope="module")
def vegas_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("vegas") / "out.json"
    rc, out, err = run_main([*BASE, *VEGAS, "--prompt", PROMPT, "--compare-ar", "--output-json", str(path)])
    assert rc == 0, err
    return json.loads(path.read_text()), out, err


# ---- bad input -------------------------------------------------------------------------------------------------


def unknown_architecture(tmp_path: Path) -> list[str]:
    folder = Path(shutil.copytree(FIXTURE, tmp_path / "unknown-arch"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "gpt_neox"}))
    return ["--model", str(folder), "--prompt", PROMPT]


def corrupt_safetensors(tmp_path: Path) -> list[str]:
    folder = Path(shutil.copytree(FIXTURE, tmp_path / "corrupt"))
    shard = folder / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return ["--model", str(folder), "--prompt", PROMPT]


def not_a_checkpoint(tmp_path: Path) -> list[str]:
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "not-a-checkpoint" / "notes.txt").write_text("hello")
    return ["--model", str(tmp_path / "not-a-checkpoint"), "--prompt", PROMPT]


# Later flags override BASE's (argparse keeps the last value). Each case: extra argv (or a function of tmp_path
# that builds it), and the strings its one error line must contain.
BAD_INPUT = {
    "prompt-longer-than-max-model-len": (["--prompt", "word " * 200], ["--max-model-len"]),
    "blank-prompt": (["--prompt", "   "], ["--prompt"]),
    "no-prompt": ([], ["--prompt"]),
    "missing-prompt-file": (lambda tmp: ["--prompt-file", str(tmp / "absent.txt")], ["--prompt-file", "absent.txt"]),
    "blank-prompt-file": (lambda tmp: ["--prompt", PROMPT, "--prompt-file", str(_a_file(tmp, " \n\t\n"))],
                          ["--prompt-file", "plain-file", "empty"]),
    "missing-model": (lambda tmp: ["--model", str(tmp / "no-such-model"), "--prompt", PROMPT],
                      ["--model", "no-such-model"]),
    "not-a-checkpoint": (not_a_checkpoint, ["--model", "not-a-checkpoint"]),
    "unknown-architecture": (unknown_architecture, ["--model", "config.json", "gpt_neox"]),
    "corrupt-safetensors": (corrupt_safetensors, ["--model", "model-00002-of-00003.safetensors"]),
    "temperature-negative": (["--prompt", PROMPT, "--temperature", "-1"], ["--temperature"]),
    "temperature-tiny": (["--prompt", PROMPT, "--temperature", "1e-40"], ["--temperature"]),
    "top-p-0": (["--prompt", PROMPT, "--top-p", "0"], ["--top-p"]),
    "top-p-1.5": (["--prompt", PROMPT, "--top-p", "1.5"], ["--top-p"]),
    "top-k-negative": (["--prompt", PROMPT, "--top-k", "-1"], ["--top-k"]),
    "max-new-tokens-0": (["--prompt", PROMPT, "--max-new-tokens", "0"], ["--max-new-tokens"]),
    "gamma-negative": (["--prompt", PROMPT, "--gamma", "-1"], ["--gamma"]),
    "sparse-ratio-0": (["--prompt", PROMPT, "--sparse-ratio", "0"], ["--sparse-ratio"]),
    "sparse-ratio-1.5": (["--prompt", PROMPT, "--sparse-ratio", "1.5"], ["--sparse-ratio"]),
    "min-sparse-tokens-0": (["--prompt", PROMPT, "--min-sparse-tokens", "0"], ["--min-sparse-tokens"]),
    "method-bogus": (["--prompt", PROMPT, "--method", "bogus"], ["--method", "bogus"]),
    "score-mode-bogus": (["--prompt", PROMPT, "--score-mode", "bogus"], ["--score-mode", "bogus"]),
    "quest-page-not-dividing-128": (["--prompt", PROMPT, "--method", "quest", "--quest-page", "24"],
                                    ["--quest-page", "24", "divide 128"]),
    "stream-sinks-0": (["--prompt", PROMPT, "--method", "streaming", "--stream-sinks", "0"], ["--stream-sinks"]),
    "retrieval-every-with-vegas": (["--prompt", PROMPT, *VEGAS, "--retrieval-every", "2"],
                                   ["--retrieval-every 2", "--method retrieval only", "'vegas'"]),
    "prompt-plus-new-tokens-over-max-model-len": (["--prompt", PROMPT, "--max-new-tokens", "120"],
                                                  ["--max-new-tokens", "--max-model-len"]),
    "max-new-tokens-not-a-number": (["--prompt", PROMPT, "--max-new-tokens", "12x"], ["--max-new-tokens", "12x"]),
    "unknown-flag": (["--prompt", PROMPT, "--gama", "3"], ["--gama"]),
    "compile-cache-dir-is-a-file": (lambda tmp: ["--prompt", PROMPT, "--compile-cache-dir", str(_a_file(tmp))],
                                    ["--compile-cache-dir", "plain-file", "cannot be used as a cache folder"]),
    "slots-0": (["--prompt", PROMPT, "--slots", "0"], ["--slots"]),
    "refill-over-slots": (["--prompt", PROMPT, "--slots", "2", "--refill", "3"], ["--refill", "--slots 2"]),
    "refill-without-slots": (["--prompt", PROMPT, "--refill", "1"], ["--refill", "--slots"]),
    "stream-with-slots": (["--prompt", PROMPT, "--slots", "1", "--stream"], ["--stream", "--slots"]),
    "temperature-infinite": (["--prompt", PROMPT, "--temperature", "inf"], ["--temperature"]),
    "top-k-past-32-bits": (["--prompt", PROMPT, "--temperature", "1", "--top-k", "3000000000"], ["--top-k"]),
    "top-k-with-greedy": (["--prompt", PROMPT, "--top-k", "5"], ["--top-k", "--temperature 0"]),
    "top-p-with-greedy": (["--prompt", PROMPT, "--top-p", "0.9"], ["--top-p", "--temperature 0"]),
    "seed-past-32-bits": (["--prompt", PROMPT, "--seed", "2147483648"], ["--seed"]),
    "last-request-seed-past-32-bits": (["--prompt", PROMPT, "--prompt", PROMPT, "--seed", "2147483647"],
                                       ["--seed 2147483647", "2 requests"]),
    "gamma-huge": (["--prompt", PROMPT, *VEGAS, "--gamma", "100000"], ["--gamma"]),
    "compare-ar-with-ar": (["--prompt", PROMPT, "--method", "ar", "--compare-ar"], ["--compare-ar", "--method"]),
    "draft-weights-int3": (["--prompt", PROMPT, *VEGAS, "--draft-weights", "int3"], ["--draft-weights", "int3"]),
    "draft-weights-without-drafts": (["--prompt", PROMPT, "--draft-weights", "int8"], ["--draft-weights", "--method ar"]),
    "draft-activations-int4": (["--prompt", PROMPT, *VEGAS, "--draft-weights", "int8", "--draft-activations", "int4"],
                               ["--draft-activations", "int4"]),
    "draft-activations-bf16-weights": (["--prompt", PROMPT, *VEGAS, "--draft-activations", "int8"],
                                       ["--draft-activations", "--draft-weights int8 or int4"]),
    "gamma-auto-with-ar": (["--prompt", PROMPT, "--gamma", "auto"], ["--gamma auto", "--method ar"]),
    "gamma-not-auto": (["--prompt", PROMPT, *VEGAS, "--gamma", "fast"], ["--gamma", "fast"]),
    "gamma-max-without-auto": (["--prompt", PROMPT, *VEGAS, "--gamma-max", "4"], ["--gamma-max", "--gamma auto"]),
    "gamma-costs-without-auto": (["--prompt", PROMPT, *VEGAS, "--gamma-costs", "1.5,2"],
                                 ["--gamma-costs", "--gamma auto"]),
    "gamma-costs-count": (["--prompt", PROMPT, *VEGAS, "--gamma", "auto", "--gamma-max", "3", "--gamma-costs", "1.5,2"],
                          ["--gamma-costs", "--gamma-max", "(3), got 2"]),
    "gamma-costs-below-1": (["--prompt", PROMPT, *VEGAS, "--gamma", "auto", "--gamma-max", "2", "--gamma-costs",
                             "0.5,2"], ["--gamma-costs", ">= 1"]),
    "gamma-costs-with-a-tree": (["--prompt", PROMPT, *VEGAS, "--gamma", "auto", "--draft-tree", "4x2", "--gamma-costs",
                                 "1.5"], ["--gamma auto", "--draft-tree"]),
    "gamma-costs-not-numbers": (["--prompt", PROMPT, *VEGAS, "--gamma", "auto", "--gamma-costs", "1.5;2"],
                                ["--gamma-costs", "1.5;2"]),
    "tree-rates-not-numbers": (["--prompt", PROMPT, "--draft-tree", "8", "--drafter", "ngram", "--tree-rates",
                                "0.7,x"], ["--tree-rates", "0.7,x"]),
    "tree-rates-increasing": (["--prompt", PROMPT, "--draft-tree", "8", "--drafter", "ngram", "--tree-rates",
                               "0.3,0.6"], ["--tree-rates", "non-increasing"]),
    "tree-rates-with-a-full-tree": (["--prompt", PROMPT, "--draft-tree", "3x2", "--drafter", "ngram", "--tree-rates",
                                     "0.7,0.1"], ["--tree-rates", "--draft-tree 3x2"]),
    "draft-tree-too-deep-for-its-rates": (["--prompt", PROMPT, "--draft-tree", "7d2", "--drafter", "ngram"],
                                          ["--draft-tree 7d2", "--tree-rates", "holds fewer"]),
    "output-json-under-a-file": (lambda tmp: ["--prompt", PROMPT, "--output-json", str(_a_file(tmp) / "out.json")],
                                 ["--output-json", "out.json"]),
    "repetition-penalty-0": (["--prompt", PROMPT, "--repetition-penalty", "0"], ["--repetition-penalty", "> 0"]),
    "repetition-penalty-negative": (["--prompt", PROMPT, "--repetition-penalty", "-1.2"], ["--repetition-penalty"]),
    "presence-penalty-3": (["--prompt", PROMPT, "--presence-penalty", "3"], ["--presence-penalty", "[-2, 2]"]),
    "frequency-penalty-below-2": (["--prompt", PROMPT, "--frequency-penalty", "-2.5"], ["--frequency-penalty"]),
    "min-p-1.5": (["--prompt", PROMPT, "--temperature", "1", "--min-p", "1.5"], ["--min-p", "[0, 1]"]),
    "min-p-with-greedy": (["--prompt", PROMPT, "--min-p", "0.1"], ["--min-p", "--temperature 0"]),
    "logprobs-beyond-the-vocabulary": (["--prompt", PROMPT, "--logprobs", "289"], ["--logprobs 289", "288 tokens"]),
    "logprobs-negative": (["--prompt", PROMPT, "--logprobs", "-1"], ["--logprobs"]),
    "stop-token-id-beyond-the-vocabulary": (["--prompt", PROMPT, "--stop-token-id", "288"],
                                            ["--stop-token-id", "288", "vocabulary"]),
    "stop-empty": (["--prompt", PROMPT, "--stop", ""], ["--stop", "empty"]),
    "include-stop-without-stop": (["--prompt", PROMPT, "--include-stop"], ["--include-stop", "--stop"]),
    "messages-not-json": (lambda tmp: ["--messages", str(_a_file(tmp, "[{'role': 'user'}]"))],
                          ["--messages", "plain-file", "not JSON", "line 1"]),
    "messages-not-a-list": (lambda tmp: ["--messages", str(_a_file(tmp, '{"role": "user", "content": "hi"}'))],
                            ["--messages", "plain-file", "list of"]),
    "messages-without-content": (lambda tmp: ["--messages", str(_a_file(tmp, '[{"role": "user"}]'))],
                                 ["--messages", "plain-file", "message 0", "'content'"]),
    "messages-missing-file": (lambda tmp: ["--messages", str(tmp / "absent.json")], ["--messages", "absent.json"]),
    "system-without-the-chat-template": (["--prompt", PROMPT, "--system", "Be brief.", "--no-chat-template"],
                                         ["--no-chat-template", "--system"]),
    "system-and-a-system-message": (lambda tmp: ["--system", "Be brief.", "--messages", str(_a_file(
        tmp, '[{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]'))],
        ["--system", "plain-file", "system message of its own"]),
    "draft-tree-syntax": (["--prompt", PROMPT, "--method", "vegas", "--draft-tree", "4by2"],
                          ["--draft-tree", "4by2", "DEPTHxBRANCHING"]),
    "draft-tree-over-64-nodes": (["--prompt", PROMPT, "--method", "vegas", "--draft-tree", "6x2"],
                                 ["--draft-tree 6x2", "126 drafted nodes", "64"]),
    "draft-tree-contradicting-gamma": (["--prompt", PROMPT, *VEGAS, "--draft-tree", "4x2"],
                                       ["--gamma 3", "--draft-tree 4x2", "depth 4"]),
    "draft-tree-without-a-method": (["--prompt", PROMPT, "--draft-tree", "2x2"], ["--draft-tree 2x2", "--method"]),
    "drafter-bogus": (["--prompt", PROMPT, "--method", "vegas", "--draft-tree", "2x2", "--drafter", "eagle"],
                      ["--drafter", "eagle"]),
    "drafter-without-a-tree": (["--prompt", PROMPT, "--drafter", "ngram"], ["--drafter ngram", "--draft-tree"]),
    "ngram-drafter-with-a-method": (["--prompt", PROMPT, *VEGAS[:2], "--draft-tree", "2x2", "--drafter", "ngram"],
                                    ["--drafter ngram", "--method vegas"]),
    "draft-tree-with-penalties": (["--prompt", PROMPT, "--method", "vegas", "--draft-tree", "2x2",
                                   "--repetition-penalty", "1.2"], ["--draft-tree", "--repetition-penalty"]),
    "draft-tree-with-quest": (["--prompt", PROMPT, "--method", "quest", "--draft-tree", "2x2"],
                              ["--draft-tree", "--method quest"]),
    "draft-tree-with-phase-times": (["--prompt", PROMPT, "--method", "vegas", "--draft-tree", "2x2",
                                     "--phase-times"], ["--phase-times", "--draft-tree"]),
    # Bytes that are not UTF-8 reach Python's argv as lone surrogates (os.fsdecode does the same).
    "stop-not-utf-8": (["--prompt", PROMPT, "--stop", os.fsdecode(b"\xff")], ["--stop", "not UTF-8", "byte 0xff"]),
    "prompt-not-utf-8": (["--prompt", PROMPT, "--prompt", os.fsdecode(b"\xff\xfe hi")],
                         ["--prompt: prompt 1", "not UTF-8", "byte 0xff at character 0"]),
    "system-not-utf-8": (["--prompt", PROMPT, "--system", os.fsdecode(b"be \xff")], ["--system", "byte 0xff"]),
    "prompt-file-not-utf-8": (lambda tmp: ["--prompt-file", str(_a_file(tmp, b"caf\xe9"))],
                              ["--prompt-file", "plain-file", "not UTF-8", "byte 0xe9 at offset 3"]),
    "prompt-file-longer-than-the-context": (lambda tmp: ["--prompt", PROMPT, "--prompt-file",
                                                         str(_a_file(tmp, "word " * 200))],
                                            ["--prompt-file", "plain-file", "tokens", "--max-model-len 128"]),
    "messages-longer-than-the-context": (lambda tmp: ["--prompt", PROMPT, "--messages", str(_a_file(
        tmp, json.dumps([{"role": "user", "content": "word " * 200}])))], ["--messages", "plain-file", "tokens"]),
    "messages-lone-surrogate": (lambda tmp: ["--messages", str(_a_file(
        tmp, r'[{"role": "user", "content": "a\ud800"}]'))], ["--messages", "plain-file", "message 0", "U+D800"]),
    "messages-unknown-role": (lambda tmp: ["--messages", str(_a_file(tmp, '[{"role": "wizard", "content": "hi"}]'))],
                              ["--messages", "plain-file", "message 0", "'wizard'", "user"]),
    "output-json-under-proc": (["--prompt", PROMPT, "--output-json", "/proc/vegas-out.json"],
                               ["--output-json /proc/vegas-out.json", "cannot be written"]),
    "output-json-under-sys": (["--prompt", PROMPT, "--output-json", "/sys/vegas-out.json"],
                              ["--output-json /sys/vegas-out.json", "cannot be written"]),
}


def _a_file(tmp_path: Path, text: str | bytes = "not a folder") -> Path:
    path = tmp_path / "plain-file"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_with_one_error_line_naming_the_culprit(case, tmp_path, capsys):
    """Status 2, and stderr is exactly one `error:` line (no traceback, no usage) containing the needles."""
    extra, needles = BAD_INPUT[case]
    rc = generate.main([*BASE, *(extra(tmp_path) if callable(extra) else extra)])
    _, err = capsys.readouterr()
    lines = err.splitlines()
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for needle in needles:
        assert needle in lines[0]


def test_flags_come_from_vegas_variables_and_the_command_line_wins(reference, monkeypatch, capsys, tmp_path):
    """VEGAS_<FLAG> sets a flag's default: the run below takes its model, cache length, seed, quietness and JSON
    path from the environment, and its token count from the command line over VEGAS_MAX_NEW_TOKENS; the library's
    greedy continuation is the reference."""
    _, ref = reference
    path = tmp_path / "out.json"
    for flag, value in (("MODEL", str(FIXTURE)), ("DTYPE", "float32"), ("MAX_MODEL_LEN", "128"), ("SEED", "5"),
                        ("QUIET", "yes"), ("OUTPUT_JSON", str(path)), ("MAX_NEW_TOKENS", "7")):
        monkeypatch.setenv("VEGAS_" + flag, value)
    rc = generate.main(["--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.endswith(f"\n{ref.text}\n")
    config = json.loads(path.read_text())["config"]
    assert (config["max_model_len"], config["seed"], config["max_new_tokens"]) == (128, 5, MAX_NEW)


def test_help_works_whatever_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VEGAS_GAMA", "3")  # refused by a run, not by --help
    assert generate.main(["--help"]) == 0
    assert "VEGAS_<FLAG>" in capsys.readouterr().out


def test_drafts_almost_never_accepted_get_a_warning(vegas_run):
    """A collapse of acceptance is said in a line of its own; the fixture's run (acceptance about 0.4) gets none."""
    options = GenerationOptions(method="vegas")
    metrics = {"gamma": 6, "iterations": 40, "tau": 1.05, "acceptance_rate": 0.05 / 6}
    warning = generate.low_acceptance_warning(options, metrics)
    assert warning.startswith("warning: only 0.8% of the drafts were accepted")
    assert warning.endswith("exact. --gamma auto falls back to plain steps when drafts lose, a larger --sparse-ratio "
                            "drafts from more of the cache, --method ar skips drafting")
    assert generate.low_acceptance_warning(options, {**metrics, "acceptance_rate": 0.1}) is None
    assert generate.low_acceptance_warning(options, {**metrics, "iterations": 7}) is None  # too few to say
    plain = {**metrics, "gamma": 0, "acceptance_rate": None}
    assert generate.low_acceptance_warning(GenerationOptions(), plain) is None
    doc, _, err = vegas_run
    assert doc["metrics"]["acceptance_rate"] >= 0.1 and "warning: only" not in err


@pytest.mark.parametrize("options,remedies", [
    (GenerationOptions(method="vegas", gamma="auto"), "a larger --sparse-ratio drafts from more of the cache, "
                                                      "--method ar skips drafting"),
    (GenerationOptions(draft_tree="3x2", drafter="ngram"), "prompt lookup finds little of the output in the prompt "
                                                           "here: without --draft-tree no drafts are made"),
    (GenerationOptions(method="vegas", draft_tree="3x2"), "a smaller --draft-tree drafts fewer nodes, a larger "
                                                          "--sparse-ratio drafts from more of the cache, --method ar "
                                                          "without --draft-tree skips drafting"),
    # An NSA model's self drafter (sink and window) runs with --method ar.
    (GenerationOptions(draft_tree="3x2"), "a smaller --draft-tree drafts fewer nodes, without --draft-tree no "
                                          "drafts are made"),
])
def test_the_low_acceptance_warning_suggests_what_applies_to_the_run(options, remedies):
    """No flag the run could not take: --gamma auto is refused with a tree, and adaptive γ needs no telling."""
    warning = generate.low_acceptance_warning(options, {"gamma": 3, "iterations": 40, "tau": 1.0,
                                                        "acceptance_rate": 0.0})
    assert warning.endswith("the output is still exact. " + remedies), warning


def test_switches_and_typed_values_parse_from_variables():
    parser = generate.build_parser()
    env = {"VEGAS_CHAT_TEMPLATE": "off", "VEGAS_COMPARE_AR": "1", "VEGAS_MAX_NEW_TOKENS": "2K", "VEGAS_GAMMA": "auto",
           "VEGAS_KERNELS": "interpret", "VEGAS_CODE": "abc123", "OTHER": "x"}
    taken = flag_environment.apply(parser, {**env, "VEGAS_MODEL": ""})  # empty: unset
    args = parser.parse_args(["--gamma", "3"])
    assert (args.chat_template, args.compare_ar, args.max_new_tokens, args.gamma) == (False, True, 2048, 3)
    assert args.model is None and taken == {"chat_template": "VEGAS_CHAT_TEMPLATE", "compare_ar": "VEGAS_COMPARE_AR",
                                            "max_new_tokens": "VEGAS_MAX_NEW_TOKENS", "gamma": "VEGAS_GAMMA"}
    # What the command line gives, however spelt: an abbreviation, --flag=value, a --no- switch.
    argv = ["--gamma=3", "--temp", "0.5", "--no-chat", "--prompt", "x"]
    assert flag_environment.given(generate.build_parser(), argv) == {"gamma", "temperature", "chat_template",
                                                                     "prompt"}


@pytest.mark.parametrize("env, argv, needle", [
    ({"VEGAS_GAMA": "3"}, [], "VEGAS_GAMA: no flag has this variable"),
    ({"VEGAS_GAMMA": "x"}, [], "VEGAS_GAMMA=x: not a whole number or auto"),
    ({"VEGAS_DTYPE": "fp8"}, [], "VEGAS_DTYPE=fp8: one of auto, bfloat16, float32"),
    ({"VEGAS_QUIET": "maybe"}, [], "VEGAS_QUIET=maybe: a switch is one of"),
    ({"VEGAS_STOP": "x"}, [], "VEGAS_STOP: --stop is repeatable and has no variable"),
    # A value the options refuse is named by where it came from: the variable, unless the command line gave it.
    ({"VEGAS_TOP_P": "1.5"}, ["--prompt", PROMPT], "VEGAS_TOP_P"),
    ({"VEGAS_TOP_P": "0.5"}, ["--prompt", PROMPT, "--top-p", "1.5"], "--top-p"),
    ({"VEGAS_TEMPERATURE": "0.5"}, ["--prompt", PROMPT, "--temp", "-1"], "--temperature"),  # an abbreviation
])
def test_bad_variables_give_one_error_line_naming_them(env, argv, needle, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc = generate.main([*BASE, *argv])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: {needle}"), err


def test_a_compile_cache_folder_from_the_environment_is_named_by_its_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("VEGAS_COMPILE_CACHE_DIR", str(_a_file(tmp_path)))
    rc = generate.main([*BASE, "--prompt", PROMPT])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"error: VEGAS_COMPILE_CACHE_DIR {tmp_path / 'plain-file'}: cannot be used as a cache folder")


def test_gamma_beyond_what_the_verification_kernel_scores_is_refused(monkeypatch, capsys):
    """With kernels (here in interpret mode), verification collects scores for one block of 128 query rows per KV
    head: the fixture's two query heads per KV head allow γ + 1 <= 64, and γ = 64 gets one line naming --gamma
    before anything compiles."""
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    rc = generate.main([*BASE, "--prompt", PROMPT, *VEGAS, "--gamma", "64"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("error: --gamma 64: the verification kernel scores at most 64 tokens") and err.count("\n") == 1


def test_stream_refuses_a_step_count_below_one():
    """A step limit that never moves would loop forever: `Engine.stream` refuses it before compiling."""
    engine = Engine(load_model(str(FIXTURE), jnp.float32))
    for bad in (0, -1):
        with pytest.raises(InputError, match="steps_per_call"):
            next(engine.stream([PROMPT], GenerationOptions(max_new_tokens=4), steps_per_call=bad))


# ---- --output-json and --compare-ar ------------------------------------------------------------------------------


def test_output_json_has_config_requests_and_metrics(vegas_run, reference):
    out, *_ = vegas_run
    engine, ref = reference
    config = out["config"]
    assert (config["model"], config["dtype"], config["method"]) == (str(FIXTURE), "float32", "vegas")
    assert (config["max_new_tokens"], config["max_model_len"], config["gamma"]) == (MAX_NEW, 128, 3)
    assert (config["sparse_ratio"], config["min_sparse_tokens"], config["prompts"]) == (0.9, 4, 1)

    (request,) = out["requests"]
    assert request["prompt_tokens"] == len(engine.encode_prompts([PROMPT])[0]) == ref.prompt_tokens
    assert request["tokens"] == ref.tokens and len(ref.tokens) == MAX_NEW
    assert request["text"] == ref.text
    assert request["metrics"]["generated_tokens"] == MAX_NEW

    m = out["metrics"]
    assert set(m) >= {"load_s", "compile_s", "prefill_s", "decode_s", "decode_tokens_per_s"}
    assert m["decode_tokens_per_s"] == pytest.approx((MAX_NEW - 1) / m["decode_s"])
    # γ = 3 drafts per iteration: fewer iterations than decoded tokens, at most γ + 1 tokens each.
    assert 1 < m["tau"] <= 4 and 0 < m["acceptance_rate"] <= 1
    assert 0 < m["iterations"] < MAX_NEW - 1
    assert len(m["acceptance_by_position"]) == 3


def _why_slower(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("why slower:")]


def test_a_slowdown_is_explained_in_one_line(vegas_run):
    """A speedup below 1 (on this CPU it is: a tiny model, 40 tokens of context) comes with one line saying why."""
    out, _, err = vegas_run
    why = _why_slower(err)
    assert len(why) == (out["speedup_vs_ar"] < 1)
    if why:
        assert f"{out['metrics']['tau']:.2f} plain steps" in why[0]
        assert "3 draft passes and a 4-token verification" in why[0]


# Each kind of iteration, and how the slowdown line describes its work.
ITERATIONS = {
    "chain": (GenerationOptions(method="vegas", gamma=3), {}, "3 draft passes and a 4-token verification"),
    "adaptive": (GenerationOptions(method="vegas", gamma="auto", gamma_max=4), {"gamma_chosen_mean": 2.25},
                 "2.25 draft passes on average (gamma auto, at most 4) and a 3.25-token verification"),
    "adaptive-before-any-iteration": (GenerationOptions(method="vegas", gamma="auto"), {"gamma_chosen_mean": None},
                                      "up to 8 draft passes (gamma auto) and a verification of one token more"),
    "tree": (GenerationOptions(method="vegas", draft_tree="3x2"), {},
             "3 draft passes for a 3x2 tree of 14 drafts and a 15-token verification"),
    "ngram-tree": (GenerationOptions(draft_tree="3x2", drafter="ngram"), {},
                   "a prompt lookup for a 3x2 tree of 14 drafts and a 15-token verification"),
    # The SSV planner's choice is in the options the run decoded with: a tree, or none at all.
    "ssv-tree": (GenerationOptions(draft_tree="4x1", ssv_profile="p.json"), {},
                 "4 draft passes for a 4x1 tree of 4 drafts and a 5-token verification"),
}


@pytest.mark.parametrize("kind", ITERATIONS)
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_slowdown_line_describes_each_kind_of_iteration(kind, platform):
    options, metrics, work = ITERATIONS[kind]
    line = generate.slowdown_reason(platform, options, {"tau": 1.5, **metrics}, 1, 4096)
    assert line.startswith("why slower: ") and "\n" not in line
    assert f"an iteration of {work} costs more than the 1.50 " in line, line
    if platform == "gpu":
        assert line.startswith("why slower: at 1 sequence(s) of up to 4096 tokens")


def test_the_slowdown_line_when_the_planner_chose_plain_decoding():
    line = generate.slowdown_reason("cpu", GenerationOptions(ssv_profile="p.json"), {"tau": None}, 1, 4096)
    assert line.startswith("why slower: the SSV planner chose plain decoding (no drafts)"), line


def test_compare_ar_with_adaptive_gamma_explains_itself_and_writes_its_json(capsys, tmp_path, reference):
    """The comparison with --gamma auto printed, explained (on this CPU it is slower) and written."""
    _, ref = reference
    out, _, err = run_json(capsys, tmp_path, [*BASE, *VEGAS, "--gamma", "auto", "--gamma-max", "2",
                                              "--draft-weights", "int4", "--prompt", PROMPT, "--compare-ar"])
    assert [r["tokens"] for r in out["requests"]] == [ref.tokens] and out["identical_to_ar"] == [True]
    why = _why_slower(err)
    assert len(why) == (out["speedup_vs_ar"] < 1)
    if why:
        mean = out["metrics"]["gamma_chosen_mean"]
        assert f"{mean:.2f} draft passes on average (gamma auto, at most 2)" in why[0]


def test_compare_ar_of_one_token_has_no_speedup(capsys, tmp_path):
    """One new token comes from prefill: neither run decodes, so there is no ratio of their speeds to report."""
    out, _, err = run_json(capsys, tmp_path, [*BASE, *VEGAS, "--prompt", PROMPT, "--compare-ar",
                                              "--max-new-tokens", "1"])
    assert out["speedup_vs_ar"] is None and out["identical_to_ar"] == [True]
    assert "speedup vs ar: none (no token was decoded after prefill's)  identical to ar: [True]" in err
    assert not _why_slower(err)


def test_a_failure_after_decoding_keeps_the_decoded_tokens(monkeypatch, capsys, tmp_path, reference):
    """A defect in a step after decoding (here the compile-cache report) is raised with its traceback, but only
    after the text is printed and the JSON written, with the error in it."""
    _, ref = reference

    def broken():
        raise RuntimeError("a defect after decoding")

    monkeypatch.setattr(compilation, "persistent_cache_report", broken)
    path = tmp_path / "out.json"
    with pytest.raises(RuntimeError, match="a defect after decoding"):
        generate.main([*BASE, "--prompt", PROMPT, "--output-json", str(path)])
    out, err = capsys.readouterr()
    assert out.endswith(f"\n{ref.text}\n")
    doc = json.loads(path.read_text())
    assert [r["tokens"] for r in doc["requests"]] == [ref.tokens]
    assert doc["error"] == "RuntimeError: a defect after decoding" and doc["interrupted"] is False
    assert err.splitlines()[-1] == f"error: RuntimeError after decoding; the run's output was written to {path}"


def test_an_output_json_is_probed_before_the_run_and_left_absent_on_bad_input(capsys, tmp_path):
    """The test write leaves nothing behind: a run refused after it (its prompt is too long) writes no file."""
    path = tmp_path / "new-folder" / "out.json"
    rc = generate.main([*BASE, "--prompt", "word " * 200, "--output-json", str(path)])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: --prompt: prompt 0 has ")
    assert list(path.parent.iterdir()) == []


def test_compare_ar_reports_identity_and_speedup(vegas_run, reference):
    out, *_ = vegas_run
    _, ref = reference
    assert [r["tokens"] for r in out["ar"]["requests"]] == [ref.tokens]
    assert out["identical_to_ar"] == [True]
    # The sparse draft must miss sometimes, or identity with plain decoding would be trivially true.
    assert 0 < out["metrics"]["acceptance_rate"] < 1
    speedup = out["speedup_vs_ar"]
    assert speedup == pytest.approx(out["metrics"]["decode_tokens_per_s"] / out["ar"]["metrics"]["decode_tokens_per_s"])


def test_a_draft_tree_run_reports_its_tree_and_plain_decodings_tokens(capsys, tmp_path, reference):
    out, _, err = run_json(capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--draft-tree", "3x2", "--drafter", "ngram",
                                              "--compare-ar"])
    _, ref = reference
    assert [r["tokens"] for r in out["requests"]] == [ref.tokens] and out["identical_to_ar"] == [True]
    why = _why_slower(err)
    assert len(why) == (out["speedup_vs_ar"] < 1)
    if why:  # the tree's work, not γ's default
        assert "a prompt lookup for a 3x2 tree of 14 drafts and a 15-token verification" in why[0]
    metrics = out["metrics"]
    assert (metrics["draft_tree"], metrics["drafter"], metrics["gamma"]) == ("3x2", "ngram", 3)
    histogram = metrics["accepted_depth_histogram"]
    assert len(histogram) == 4 and sum(histogram) == metrics["iterations"]
    assert sum(d * n for d, n in enumerate(histogram)) == round((metrics["tau"] - 1) * metrics["iterations"])
    by_rank = ",".join(f"{x:.2f}" for x in metrics["acceptance_by_rank"])
    assert len(metrics["acceptance_by_rank"]) == 2 and f"tree 3x2 (ngram, by rank {by_rank})  accepted depths " \
        f"{histogram}" in err


# ---- prompts ---------------------------------------------------------------------------------------------------


def test_two_prompts_and_a_prompt_file_make_one_batch(capsys, tmp_path, reference):
    engine, ref = reference
    other, from_file = "Once upon a time there was a very small model", "Lorem ipsum dolor\nsit amet, ünïcode"
    (tmp_path / "prompt.txt").write_text(from_file, encoding="utf-8")
    out, stdout, _ = run_json(
        capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--prompt", other, "--prompt-file", str(tmp_path / "prompt.txt")]
    )
    requests = out["requests"]
    assert out["config"]["prompts"] == len(requests) == 3
    expected_lengths = [len(ids) for ids in engine.encode_prompts([PROMPT, other, from_file])]
    assert [r["prompt_tokens"] for r in requests] == expected_lengths
    assert requests[0]["tokens"] == ref.tokens  # batching with longer prompts leaves request 0 alone
    assert all(len(r["tokens"]) == MAX_NEW for r in requests) and requests[1]["tokens"] != requests[2]["tokens"]
    assert stdout.count("--- request ") == 3


def test_slots_queue_the_prompts_with_the_same_tokens(capsys, tmp_path):
    prompts = ["--prompt", PROMPT, "--prompt", "Once upon a time", "--prompt", "Lorem ipsum dolor sit amet"]
    together, _, _ = run_json(capsys, tmp_path, [*BASE, *VEGAS, *prompts])
    served, _, _ = run_json(capsys, tmp_path, [*BASE, *VEGAS, *prompts, "--slots", "2", "--refill", "1"])
    assert [r["tokens"] for r in served["requests"]] == [r["tokens"] for r in together["requests"]]
    m = served["metrics"]
    assert (served["config"]["slots"], m["slots"], m["refill"]) == (2, 2, 1)
    assert m["decode_tokens"] == sum(len(r["tokens"]) - 1 for r in served["requests"])


def test_no_chat_template_changes_prompt_tokens(capsys, tmp_path, vegas_run, reference):
    engine, _ = reference
    out, _, _ = run_json(capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--no-chat-template", "--max-new-tokens", "4"])
    raw = engine.encode_prompts([PROMPT], chat_template=False)[0]
    templated = engine.encode_prompts([PROMPT], chat_template=True)[0]
    assert out["config"]["chat_template"] is False
    assert out["requests"][0]["prompt_tokens"] == len(raw)
    assert vegas_run[0]["requests"][0]["prompt_tokens"] == len(templated) > len(raw)


# ---- --stream ---------------------------------------------------------------------------------------------------


def test_stream_prints_the_same_text(capsys, vegas_run):
    out, stdout, _ = vegas_run
    text = out["requests"][0]["text"]
    header = f"--- request 0 ({out['requests'][0]['prompt_tokens']} prompt tokens, {MAX_NEW} generated) ---"
    assert stdout == f"{header}\n{text}\n"
    assert generate.main([*BASE, *VEGAS, "--prompt", PROMPT, "--stream"]) == 0
    streamed, _ = capsys.readouterr()
    assert streamed == f"{text}\n"


def _stop_across_a_boundary(engine, tokens: list[int]) -> tuple[str, list[int]]:
    """A 3-character stop string across a token boundary of this output, where it first occurs; and the tokens
    through the one that completes it."""
    text = engine.tokenizer.decode(tokens)
    for k in range(4, len(tokens) - 2):
        head = engine.tokenizer.decode(tokens[: k + 1])
        stop = text[len(head) - 1 : len(head) + 2]
        if text.startswith(head) and len(stop) == 3 and "\ufffd" not in stop and text.find(stop) == len(head) - 1:
            end = next(j for j in range(k + 1, len(tokens)) if stop in engine.tokenizer.decode(tokens[: j + 1]))
            return stop, tokens[: end + 1]
    raise AssertionError("no stop string across a token boundary")


def test_stream_with_a_stop_string_and_a_conversation(capsys, tmp_path, reference):
    """--system and --messages render a conversation as the library renders its message list; --stream shows the
    text as generated but never past the stop string, which spans two tokens, and ends where the result's text
    (cut before the stop string) ends."""
    engine, _ = reference
    conversation = [{"role": "user", "content": "Say something."}]
    (tmp_path / "chat.json").write_text(json.dumps(conversation), encoding="utf-8-sig")  # a BOM is dropped
    messages = [{"role": "system", "content": "Be brief."}, *conversation]
    unstopped = engine.generate([messages], GenerationOptions(max_new_tokens=MAX_NEW, max_model_len=128))
    stop, tokens = _stop_across_a_boundary(engine, unstopped.requests[0].tokens)
    out, stdout, _ = run_json(capsys, tmp_path, [*BASE, "--system", "Be brief.", "--messages",
                                                 str(tmp_path / "chat.json"), "--stop", stop, "--stream"])
    (request,) = out["requests"]
    text = engine.tokenizer.decode(tokens)
    assert request["tokens"] == tokens and request["text"] == text[: text.find(stop)]
    assert stdout == request["text"] + "\n"
    assert out["config"]["system"] == "Be brief." and out["config"]["stop"] == [stop]


def test_stream_with_logprobs_prints_json_lines(capsys, tmp_path, reference):
    engine, ref = reference
    out, stdout, _ = run_json(capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--logprobs", "2", "--stream"])
    (request,) = out["requests"]
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert request["tokens"] == ref.tokens
    assert [(d["token"], d["logprob"], d["top_logprobs"]) for d in lines[:-1]] == [
        (e["token"], e["logprob"], e["top"]) for e in request["logprobs"]]
    assert lines[-1] == {"request": 0, "text": ref.text, "status": "ok"}
    assert all(len(e["top"]) == 2 and e["top"][0][1] >= e["logprob"] for e in request["logprobs"])


def test_score_cli_writes_what_the_library_scores(capsys, tmp_path, reference):
    engine, ref = reference
    pairs = [("The quick brown", " fox jumps"), (engine.encode_prompts([PROMPT])[0], ref.tokens)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": p, "continuation": c}) + "\n"
                                                   for p, c in pairs))
    rc = score.main(["--model", str(FIXTURE), "--dtype", "float32", "--pairs", str(tmp_path / "pairs.jsonl"),
                     "--output-json", str(tmp_path / "scores.json")])
    stdout, _ = capsys.readouterr()
    assert rc == 0
    written = json.loads((tmp_path / "scores.json").read_text())
    scored = engine.score([p for p, _ in pairs], [c for _, c in pairs])
    assert [p["tokens"] for p in written["pairs"]] == [s.tokens for s in scored]
    assert [p["sum_logprob"] for p in written["pairs"]] == pytest.approx([s.sum_logprob for s in scored], abs=1e-4)
    assert written["pairs"][1]["greedy"]  # plain greedy decoding's own tokens are each the argmax
    assert written["perplexity"] == pytest.approx(scoring.perplexity(scored), rel=1e-5)
    assert stdout.splitlines()[-1].startswith(f"perplexity {written['perplexity']:.4f} over ")


@pytest.mark.parametrize("lines,needles", [
    (['{"prompt": "a", "continuation": "b"}', "{oops"], ["--pairs", "line 2", "not JSON"]),
    ([r'{"prompt": "a", "continuation": "b\udcff"}'], ["--pairs: continuation 0", "undecodable byte 0xff"]),
    (['{"prompt": "a"}'], ["--pairs", "line 1", '"continuation"']),
    (['{"prompt": "a", "continuation": "   "}'], ["--pairs", "continuation 0", "empty"]),
    ([], ["--pairs", "no pairs"]),
])
def test_score_cli_bad_pairs_are_one_line(capsys, tmp_path, lines, needles):
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines))
    rc = score.main(["--model", str(FIXTURE), "--dtype", "float32", "--pairs", str(tmp_path / "pairs.jsonl")])
    _, err = capsys.readouterr()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert all(needle in err for needle in needles), err


@pytest.mark.parametrize("content,output,needle", [
    (b'{"prompt": "caf\xe9", "continuation": "b"}', None, "--pairs {}: not UTF-8 text (byte 0xe9 at offset 15)"),
    (b'{"prompt": "a", "continuation": "b"}', "/proc/scores.json", "--output-json /proc/scores.json: cannot be "
                                                                   "written: "),
])
def test_score_cli_refuses_unreadable_pairs_and_unwritable_outputs_before_loading(monkeypatch, capsys, tmp_path,
                                                                                   content, output, needle):
    monkeypatch.setattr(score, "load_checkpoint", lambda *_: pytest.fail("loaded before the files were checked"))
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content)
    rc = score.main(["--pairs", str(path), *(["--output-json", output] if output else [])])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: " + needle.format(path)) and err.count("\n") == 1, err


def test_score_cli_interrupted_is_one_line(monkeypatch, capsys, tmp_path):
    """SIGINT while scoring: exit 130 and one line, no traceback (the scores come all at once: none is lost)."""

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "score", interrupted)
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "continuation": "b"}')
    rc = score.main(["--model", str(FIXTURE), "--dtype", "float32", "--pairs", str(tmp_path / "pairs.jsonl")])
    assert (rc, capsys.readouterr().err) == (130, "interrupted (SIGINT)\n")


# ---- vegas_jax.convert, then generate from the Orbax copy ----------------------------------------------------


def test_converted_checkpoint_generates_the_same_tokens(capsys, tmp_path, reference):
    _, ref = reference
    orbax_dir = tmp_path / "orbax"
    assert convert.main(["--model", str(FIXTURE), "--output", str(orbax_dir), "--dtype", "float32"]) == 0
    capsys.readouterr()
    out, _, err = run_json(capsys, tmp_path, ["--model", str(orbax_dir), *COMMON, "--max-new-tokens", str(MAX_NEW),
                                              "--prompt", PROMPT])
    assert f"loaded {orbax_dir} (orbax)" in err
    assert out["requests"][0]["tokens"] == ref.tokens


# ---- the module entry point ------------------------------------------------------------------------------------


def _without_cache_settings() -> dict:
    """This environment without the JAX and CLI compile-cache settings the test session sets."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE",
                                 "VEGAS_COMPILE_CACHE"))}


def test_module_entry_point_exit_codes_and_compile_cache(reference, tmp_path):
    """`python -m vegas_jax.generate` prints the library's text and, by default, keeps its compiled programs in the
    user cache folder ($XDG_CACHE_HOME/vegas-jax/compiled); a second process given that folder as
    --compile-cache-dir (here through $VEGAS_COMPILE_CACHE_DIR) reads every program it needs from it, compiles
    none, and prints the same text. Both run without the caller's JAX cache settings."""
    _, ref = reference
    cmd = [sys.executable, "-m", "vegas_jax.generate", *BASE]
    env = _without_cache_settings() | {"XDG_CACHE_HOME": str(tmp_path / "user-cache")}
    cache = tmp_path / "user-cache" / "vegas-jax" / "compiled"
    report = re.compile(rf"compile cache {re.escape(str(cache))}: (\d+) programs read from it, (\d+) compiled")
    ok = subprocess.run([*cmd, "--prompt", PROMPT], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith(f"\n{ref.text}\n")
    first = report.search(ok.stderr)
    assert first and int(first[2]) > 0 and any(cache.iterdir()), ok.stderr
    again = subprocess.run([*cmd, "--prompt", PROMPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**env, "VEGAS_COMPILE_CACHE_DIR": str(cache)})
    assert again.returncode == 0 and again.stdout == ok.stdout, again.stderr
    second = report.search(again.stderr)
    assert second and (int(second[1]), int(second[2])) == (int(first[1]) + int(first[2]), 0), again.stderr
    bad = subprocess.run([*cmd, "--prompt", PROMPT, "--top-p", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert (bad.returncode, bad.stderr) == (2, "error: --top-p must be in (0, 1], got 0.0\n")


def test_a_default_cache_folder_that_cannot_be_made_costs_a_note_and_off_keeps_none(tmp_path):
    """The default folder is a convenience: where it cannot be made (here $XDG_CACHE_HOME is a file) the run goes
    on with one note naming what to pass; `--compile-cache-dir off` keeps no programs and says nothing of it."""
    env = _without_cache_settings() | {"XDG_CACHE_HOME": str(_a_file(tmp_path))}
    cmd = [sys.executable, "-m", "vegas_jax.generate", *BASE, "--prompt", PROMPT, "--dry-run", "--quiet"]
    noted = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert noted.returncode == 0, noted.stderr
    notes = [line for line in noted.stderr.splitlines() if line.startswith("note: compiled programs are not kept")]
    assert len(notes) == 1 and "the default --compile-cache-dir" in notes[0] and "'off'" in notes[0], noted.stderr
    off = subprocess.run([*cmd, "--compile-cache-dir", "off"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert off.returncode == 0 and "compiled programs" not in off.stderr, off.stderr
    assert off.stdout == noted.stdout


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_phase_times_split_an_iteration(capsys, tmp_path, method):
    out, _, _ = run_json(capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--method", method, "--phase-times"])
    phases = out["metrics"]["phase_ms"]
    assert set(phases) == {"draft_ms", "verify_ms", "accept_ms", "select_ms"}
    # Plain decoding has no draft and no selection (reported as exactly 0, never timed); Vegas times both.
    assert (phases["draft_ms"] != 0) == (phases["select_ms"] != 0) == (method == "vegas")


def test_token_counts_take_k_suffixes(capsys, tmp_path):
    out, _, _ = run_json(capsys, tmp_path, [*BASE, "--prompt", PROMPT, "--max-model-len", "1K"])
    assert out["config"]["max_model_len"] == 1024


def _strict(text: str) -> dict:
    """JSON as the standard has it: NaN and Infinity, which json.dumps writes by default, are refused."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("slots", [None, 1])
def test_a_decode_of_no_measured_time_has_no_speed(monkeypatch, capsys, tmp_path, slots):
    """A clock that does not move (decode_s exactly 0, as a coarse clock can give): no tokens/s, no speedup, and a
    JSON that is JSON (null, never NaN), printed and written, from generate and from serve."""
    from vegas_jax.runtime import engine as engine_module, pacing

    frozen = type("Frozen", (), {"perf_counter": staticmethod(lambda: 1.0)})
    for module in (engine_module, pacing):  # the engine's clock, and the decode calls' (pacing.DecodeCalls)
        monkeypatch.setattr(module, "time", frozen)
    path = tmp_path / "out.json"
    argv = [*BASE, *VEGAS, "--prompt", PROMPT, "--compare-ar", "--output-json", str(path)]
    assert generate.main([*argv, *(["--slots", str(slots)] if slots else [])]) == 0
    _, err = capsys.readouterr()
    doc = _strict(path.read_text())
    for run in (doc, doc["ar"]):
        assert run["metrics"]["decode_s"] == 0 and run["metrics"]["decode_tokens_per_s"] is None
    assert doc["speedup_vs_ar"] is None
    assert "decode 0.00s  - tok/s" in err and "speedup vs ar: none" in err


def test_the_embedded_model_drafts_with_its_shipped_head(capsys, tmp_path):
    """--drafter head on the embedded model without --draft-head takes the head shipped for its --attention (the
    SmolLM2 target it was trained for, loaded: a plan's dry run); another model needs --draft-head, in one line."""
    from vegas_jax.loading.draft_head_checkpoint import EMBEDDED_HEADS, embedded_head

    head = ["--drafter", "head", "--draft-tree", "4x2", "--prompt", PROMPT, "--dry-run", "--quiet"]
    for attention in ("dense", "nsa-view"):
        out, _, _ = run_json(capsys, tmp_path, [*head, "--attention", attention])
        assert out["draft_head"] == str(EMBEDDED_HEADS / attention) and out["plan"]["drafter"] == "head"
        assert out["plan"]["draft_tree_parents"] == [-1, 0, 0, 1, 1, 2, 2, *[i for i in range(3, 15) for _ in "ab"]]
    shaped, _, _ = run_json(capsys, tmp_path, [*head[:3], "5d3", *head[4:], "--tree-rates", "0.6,0.3"])
    # Path chances 0.6, 0.3 (depth 1), 0.36, 0.18 (under the first), 0.216: the tie at 0.18 goes to the earlier.
    assert shaped["plan"]["draft_tree_parents"] == [-1, 0, 0, 1, 1, 3]
    out, _, _ = run_json(capsys, tmp_path, ["--prompt", PROMPT, "--dry-run", "--quiet"])
    assert out["draft_head"] is None
    # The shipped heads count their training prompts' tokens: a draft vocabulary of the 8,192 most frequent.
    vocab, _, _ = run_json(capsys, tmp_path, [*head, "--draft-vocab", "8192"])
    assert vocab["draft_vocab"] == 8192 and vocab["plan"]["drafter"] == "head"
    for flags, needle in [(["--draft-vocab", "8192", "--prompt", PROMPT], "error: --draft-vocab: only with --drafter "
                                                                          "head and a --draft-tree"),
                          ([*head, "--draft-vocab", "50000"], "error: --draft-vocab must be in [0, 49152]")]:
        assert generate.main(flags) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(needle), line
    assert generate.main([*BASE, *head]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --drafter head: this engine has no draft head"), line
    with pytest.raises(InputError, match="^attention nsa: the embedded model ships draft heads for dense, nsa-view "
                                         "only"):
        embedded_head("nsa")
