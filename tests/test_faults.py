"""The library and the CLI under bad input and faults: prompts and options of the wrong kind are refused naming the
Python argument (the CLI names its flag), a bad VEGAS_KERNELS or a corrupt checkpoint is one error line, a request
whose logits become non-finite fails alone (the others' outputs are those of their solo runs), and SIGINT stops
decoding at the next return to the host, keeping what finished."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.test_cli import BASE, COMMON, FIXTURE, MAX_NEW, PROMPT, REPO, run_main
from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine
from vegas_jax import generate
from vegas_jax.cli import arguments, outputs
from vegas_jax.attention.backend import default_backend, default_scan_layers
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError
from vegas_jax.runtime.pacing import Pacer
from vegas_jax.loading import CheckpointError, load_model
from vegas_jax.loading.orbax_ckpt import save_orbax

OPTIONS = GenerationOptions(max_new_tokens=4, max_model_len=128)


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model(str(FIXTURE), jnp.float32))


# What the CLI runs with BASE.
REFERENCE = GenerationOptions(max_new_tokens=MAX_NEW, max_model_len=128)


@pytest.fixture(scope="module")
def reference(engine):
    """The library's plain greedy decoding of PROMPT."""
    return engine.generate([PROMPT], REFERENCE).requests[0]


# ---- prompts -----------------------------------------------------------------------------------------------------


def test_a_bare_string_is_one_prompt(engine, reference):
    (ids,) = engine.encode_prompts([PROMPT])
    assert engine.encode_prompts(PROMPT) == [ids]
    result = engine.generate(PROMPT, REFERENCE)
    assert [(r.prompt_tokens, r.tokens) for r in result.requests] == [(len(ids), reference.tokens)]


def test_token_ids_as_lists_tuples_and_integer_arrays(engine):
    rows = [[5, 6, 7], [8, 9, 10]]
    for batch in (rows, np.array(rows), np.array(rows, np.uint16), [np.array(r, np.int32) for r in rows],
                  [tuple(np.int64(t) for t in r) for r in rows], [jnp.asarray(r) for r in rows]):
        encoded = engine.encode_prompts(batch)
        assert encoded == rows and all(type(t) is int for p in encoded for t in p)


# Each case: the batch, and what its message says after "prompts".
BAD_PROMPTS = {
    "float-ids": ([[5.5, 6.0]], ": prompt 0 has a token id that is not an integer at position 0: 5.5 (float)"),
    "string-ids": ([["5", "6"]], ": prompt 0 has a token id that is not an integer at position 0: '5' (str)"),
    "bool-ids": ([[7, True]], ": prompt 0 has a token id that is not an integer at position 1: True (bool)"),
    "flat-ids": ([5, 6], " is a flat sequence of integers"),
    "float-array": (np.array([[5.5, 6.0]]), ": an array of prompts must be 2-D and of integer token ids"),
    "1-d-array": (np.array([5, 6]), ": an array of prompts must be 2-D"),
    "3-d-array": (np.zeros((1, 2, 2), np.int32), ": an array of prompts must be 2-D"),
    "2-d-array-prompt": ([np.array([[5, 6]])], ": prompt 0 is an array of shape (1, 2)"),
    "bytes": ([b"hi"], ": prompt 0 is bytes"),
    "dict": (["hi", {"text": "hi"}], ": prompt 1 is a dict; a prompt is a string, a sequence of token ids or a list"),
    "dicts": ([{"role": "user", "content": "hi"}], " is a flat list of messages"),
    "message-without-a-role": ([[{"text": "hi"}]], ": prompt 0: message 0 needs a string 'role' (missing)"),
    "none": (None, " must be a list of prompts"),
    "no-prompt": ([], ": no prompt given"),
    "no-tokens": ([[5], []], ": prompt 1 has no tokens"),
    "whitespace": (["hi", " \n\t"], ": prompt 1 is empty (whitespace only)"),
    "negative-id": ([[-1, 5]], ": prompt 0 has token ids outside the vocabulary [0, 288): [-1]"),
    "id-past-the-vocabulary": ([[5, 288]], ": prompt 0 has token ids outside the vocabulary [0, 288): [288]"),
    "lone-surrogate": (["hi", "a \ud800"], ": prompt 1 is not UTF-8 text: lone surrogate U+D800 at character 2"),
    # What Python makes of bytes that are not UTF-8 (argv, file names, os.fsdecode).
    "undecodable-byte": ([os.fsdecode(b"\xff hi")], ": prompt 0 is not UTF-8 text: undecodable byte 0xff at "
                                                    "character 0"),
    "lone-surrogate-in-a-message": ([[{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}]],
                                    ": prompt 0: message 1 'content' is not UTF-8 text: lone surrogate U+DFFF at "
                                    "character 0"),
    "lone-surrogate-in-a-tool-call": ([[{"role": "assistant", "content": "", "tool_calls": [{"name": "\ud800"}]}]],
                                      ": prompt 0: message 0 'tool_calls' is not UTF-8 text: lone surrogate U+D800"),
    "unknown-role": ([[{"role": "wizard", "content": "hi"}]], ": prompt 0: message 0 has role 'wizard'; a role is "
                                                              "one of system, developer, user, assistant, tool"),
}


@pytest.mark.parametrize("case", BAD_PROMPTS)
def test_bad_prompts_are_refused_naming_the_argument(engine, case):
    batch, message = BAD_PROMPTS[case]
    with pytest.raises(InputError) as e:
        engine.check_input(batch, OPTIONS)
    assert str(e.value).startswith("prompts" + message), str(e.value)


# ---- options -----------------------------------------------------------------------------------------------------

BAD_OPTIONS = [("max_new_tokens", 4.0), ("max_new_tokens", "4"), ("max_new_tokens", True), ("max_new_tokens", None),
               ("temperature", "0.8"), ("temperature", True), ("top_k", 1.5), ("top_p", "1"), ("seed", 0.0),
               ("method", 3), ("gamma", 2.0), ("sparse_ratio", "0.1"), ("min_sparse_tokens", np.float32(4)),
               ("score_mode", None), ("max_model_len", 128.0), ("prefill_chunk", None)]


@pytest.mark.parametrize("field,value", BAD_OPTIONS)
def test_wrongly_typed_options_are_refused_before_anything_compiles(engine, field, value):
    fresh = Engine(engine.model)
    kind = {str: "a string", float: "a number"}.get(type(getattr(OPTIONS, field)), "an integer")
    with pytest.raises(InputError, match=re.escape(f"{field} must be {kind}, got {value!r} ({type(value).__name__})")):
        fresh.generate(["hi"], dataclasses.replace(OPTIONS, **{field: value}))
    assert not fresh.programs


@pytest.mark.parametrize("stop,message", [
    (("END", "\ud800"), "stop: stop string 1 is not UTF-8 text: lone surrogate U+D800 at character 0"),
    (os.fsdecode(b"\xff"), "stop: stop string 0 is not UTF-8 text: undecodable byte 0xff at character 0"),
])
def test_stop_strings_that_are_not_utf8_are_refused(engine, stop, message):
    with pytest.raises(InputError) as e:
        engine.check_input(["hi"], dataclasses.replace(OPTIONS, stop=stop))
    assert str(e.value) == message


def test_a_prompt_longer_than_the_context_is_named_by_its_index(engine):
    long = " ".join(["word"] * 200)
    with pytest.raises(InputError) as e:
        engine.check_input(["hi", long], OPTIONS)
    n = len(engine.encode_prompts([long])[0])
    assert str(e.value) == f"prompts: prompt 1 has {n} tokens, more than max_model_len 128"


def test_options_are_a_generation_options(engine):
    with pytest.raises(InputError, match=r"^options must be a GenerationOptions, not a dict: pass "
                                         r"GenerationOptions\(\*\*options\)$"):
        engine.generate(["hi"], {"max_new_tokens": 4})
    with pytest.raises(InputError, match=r"^options must be a GenerationOptions, got int$"):
        engine.check_input(["hi"], 4)
    # numpy scalars are numbers like any other, and come out as Python values.
    checked = GenerationOptions.check(GenerationOptions(max_new_tokens=np.int64(4), temperature=np.float32(0.5),
                                                        top_k=np.int32(3), max_model_len=np.uint16(128)))
    assert checked == GenerationOptions(max_new_tokens=4, temperature=0.5, top_k=3, max_model_len=128)
    assert (type(checked.max_new_tokens), type(checked.temperature), type(checked.max_model_len)) == (int, float, int)


def test_library_errors_name_the_python_argument_and_the_cli_its_flag(engine):
    n = len(engine.encode_prompts(["hi"])[0])
    cases = [
        (GenerationOptions(max_new_tokens=0), "max_new_tokens must be >= 1, got 0",
         "--max-new-tokens must be >= 1, got 0"),
        (GenerationOptions(max_new_tokens=200, max_model_len=128),
         f"max_new_tokens 200: with a prompt of {n} tokens it exceeds the context of 128 tokens (max_model_len)",
         f"--max-new-tokens 200: with a prompt of {n} tokens it exceeds the context of 128 tokens (--max-model-len)"),
        (GenerationOptions(top_p=0.5), "top_p 0.5 has no effect with temperature 0 (greedy)",
         "--top-p 0.5 has no effect with --temperature 0 (greedy)"),
    ]
    for options, library, cli in cases:
        with pytest.raises(InputError) as e:
            engine.check_input(["hi"], options)
        assert str(e.value).startswith(library) and e.value.render(arguments.flag).startswith(cli)
        # Across processes too: pickled as template and values.
        assert pickle.loads(pickle.dumps(e.value)).render(arguments.flag) == e.value.render(arguments.flag)
    with pytest.raises(InputError, match=r"^steps_per_call must be None or >= 1, got 0$"):
        next(engine.stream(["hi"], OPTIONS, steps_per_call=0))
    with pytest.raises(InputError, match=r"^chat_template must be True or False, got 'no' \(str\)$"):
        engine.check_input(["hi"], OPTIONS, chat_template="no")


# ---- VEGAS_KERNELS ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,message", [
    ("bogus", "VEGAS_KERNELS must be auto or one of pallas, interpret, reference, got 'bogus'"),
    ("pallas", "VEGAS_KERNELS=pallas: the Pallas kernels need a GPU, and JAX runs on cpu; use interpret"),
])
def test_a_bad_vegas_kernels_is_one_error_line(monkeypatch, capsys, engine, value, message):
    monkeypatch.setenv("VEGAS_KERNELS", value)
    with pytest.raises(InputError, match="^" + re.escape(message)):
        engine.check_input(["hi"], OPTIONS)
    assert generate.main([*BASE, "--prompt", PROMPT]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_pallas_needs_a_gpu_of_compute_capability_8(monkeypatch):
    class Device:
        compute_capability = "7.5"

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [Device()])
    monkeypatch.delenv("VEGAS_KERNELS", raising=False)
    assert default_backend() == "reference"
    monkeypatch.setenv("VEGAS_KERNELS", "pallas")
    with pytest.raises(InputError, match=r"^VEGAS_KERNELS=pallas: .* compute capability 8\.0 or newer, GPU 0 has 7\.5"):
        default_backend()
    Device.compute_capability = "9.0"
    assert default_backend() == "pallas"
    monkeypatch.setenv("VEGAS_KERNELS", "auto")
    assert default_backend() == "pallas"


def test_the_layer_loop_scans_on_a_cpu_and_unrolls_on_a_gpu_unless_told(monkeypatch, capsys):
    """VEGAS_SCAN_LAYERS auto (the default) scans except on a GPU, where the unrolled layers decode faster; 1 and 0
    choose everywhere; anything else is one error line naming the variable, before a model loads."""
    monkeypatch.delenv("VEGAS_SCAN_LAYERS", raising=False)
    assert default_scan_layers()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not default_scan_layers()
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "1")
    assert default_scan_layers()
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "auto")
    assert not default_scan_layers()
    monkeypatch.undo()
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "0")
    assert not default_scan_layers()
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "yes")
    message = "VEGAS_SCAN_LAYERS must be auto, 0 (unrolled layers) or 1 (scanned), got 'yes'"
    assert generate.main([*BASE, "--prompt", PROMPT]) == 2
    _, err = capsys.readouterr()
    assert err == f"error: {message}\n"


# ---- checkpoint faults ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corrupt_orbax(tmp_path_factory, engine) -> Path:
    """An Orbax checkpoint of a model with one large array (a 65,536 x 64 embedding, tied) whose small arrays' data
    files are overwritten: their reads fail at once, while the embedding's is still under way. Orbax splits the
    small arrays over one or more data files from one save to the next, so every data file but the embedding's
    (the largest) is overwritten; the few-hundred-byte files are the index's nodes, left intact. Now and
    then a save puts the small arrays in the embedding's file too, leaving nothing to overwrite: it is made again."""
    small = tiny_engine(layers=1).model
    config = dataclasses.replace(small.config, vocab_size=65536)
    embed = jnp.asarray(np.random.default_rng(0).standard_normal((65536, config.hidden_size), np.float32))
    big = dataclasses.replace(small, config=config, params=dict(small.params, embed=embed), tokenizer=engine.tokenizer)
    for _ in range(8):
        folder = tmp_path_factory.mktemp("orbax") / "corrupt"
        save_orbax(big, folder)
        data = sorted((folder / "params" / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)
        small_arrays = [f for f in data[:-1] if f.stat().st_size > 4096]
        if small_arrays:
            break
    assert small_arrays, f"eight saves put the small arrays beside the embedding: {[f.stat().st_size for f in data]}"
    for f in small_arrays:
        f.write_bytes(b"garbage\n")
    return folder


def _pending_orbax_tasks() -> list:
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()
            and "orbax" in getattr(t.get_coro(), "cr_code", None).co_filename]


def test_corrupt_orbax_checkpoint_is_one_line_and_leaves_no_read_behind(corrupt_orbax):
    """Orbax closes its event loop with the other reads still pending; left so, they print dozens of tracebacks at
    interpreter exit. They must be finished (cancelled) before the error comes back."""
    with pytest.raises(CheckpointError) as caught:
        load_model(corrupt_orbax, jnp.float32)
    message = str(caught.value)
    del caught
    assert message.startswith(f"{corrupt_orbax}: cannot read the checkpoint: ValueError: OUT_OF_RANGE: Error "
                              f"reading \"") and "\n" not in message
    assert not _pending_orbax_tasks()
    rc, out, err = run_main(["--model", str(corrupt_orbax), *COMMON, "--prompt", PROMPT])
    assert (rc, out) == (2, "")
    assert err.startswith(f"error: --model {corrupt_orbax}: cannot read the checkpoint: ValueError: OUT_OF_RANGE")
    assert err.count("\n") == 1


# ---- one request fails, the others finish ---------------------------------------------------------------------

VEGAS = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=24)


@pytest.fixture
def poisoned():
    """A tiny untied model with the embedding rows of two tokens set to NaN: x, in request 1's prompt, fails it at
    its first token; y, which request 2 emits at position k, fails it right after. Requests 0 and 3 never feed
    either, neither as output nor as a draft (checked: alone they still finish). Returns the engine, holding the
    broken parameters, the batch, each request's solo run on the healthy parameters, and k."""
    engine = tiny_engine(tied=False, seed=4)
    vocab, healthy = engine.config.vocab_size, engine.model.params
    a, b, c, d = prompts([30, 18, 21, 40], vocab, seed=11)
    solo = [engine.generate([p], VEGAS).requests[0] for p in (a, c, d)]
    solo.insert(1, None)  # request 1 fails at once
    avoid = set(a + d + solo[0].tokens + solo[3].tokens)
    for k, y in enumerate(solo[2].tokens):  # request 2 emits y at position k for the first time
        if k < 6 or y in avoid | set(c + solo[2].tokens[:k]):
            continue
        for x in sorted(set(range(vocab)) - avoid - set(c + solo[2].tokens) - {y}):
            # The compiled loops take the parameters as an argument: swapping them recompiles nothing, and a
            # batch of the test's size reuses the test's loops.
            engine.model.params = dict(healthy, embed=healthy["embed"].at[jnp.asarray([x, y])].set(jnp.nan))
            if all(r.status == "ok" for r in engine.generate([a, d, a, d], VEGAS).requests):
                return engine, [a, b[:9] + [x] + b[9:], c, d], solo, k
    raise AssertionError("no pair of tokens that requests 0 and 3 never feed")


def _check_isolated(result, solo, k):
    ok, failed = [result.requests[i] for i in (0, 3)], [result.requests[i] for i in (1, 2)]
    assert [r.status for r in result.requests] == ["ok", "failed", "failed", "ok"]
    assert result.metrics["failed_requests"] == [1, 2] and result.metrics["interrupted_requests"] == []
    for got, want in zip(ok, (solo[0], solo[3])):
        assert (got.tokens, got.metrics, got.reason) == (want.tokens, want.metrics, None)
    assert failed[0].tokens == [] and failed[0].reason.startswith("non-finite logits after 0 generated tokens")
    # Up to y at most: the iteration that feeds y back emits nothing.
    tokens = failed[1].tokens
    assert 1 <= len(tokens) <= k + 1 and tokens == solo[2].tokens[: len(tokens)]
    assert failed[1].reason.startswith(f"non-finite logits after {len(tokens)} generated tokens")


def test_a_request_with_nonfinite_logits_fails_alone(poisoned):
    """In one batch, and in continuous batching (serve keeps serving the queue). One test: the setup is costly."""
    broken, batch, solo, k = poisoned
    _check_isolated(broken.generate(batch, VEGAS), solo, k)
    _check_isolated(broken.serve(batch, VEGAS, slots=2, refill=1), solo, k)


def test_cli_prints_and_writes_every_request_then_exits_1(tmp_path, capsys, engine, reference):
    """The fixture's embedding row of a token of the second prompt only, set to NaN: request 1 fails, request 0
    prints and writes plain decoding's tokens."""
    other = "Lorem ipsum dolor"
    first, second = engine.encode_prompts([PROMPT, other])
    x = next(t for t in second if t not in first + reference.tokens)
    folder = Path(shutil.copytree(FIXTURE, tmp_path / "nan-row"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["model.embed_tokens.weight"]
    tensors = load_file(shard)
    tensors["model.embed_tokens.weight"][x] = np.nan
    save_file(tensors, shard)
    path = tmp_path / "out.json"
    rc = generate.main(["--model", str(folder), *COMMON, "--max-new-tokens", str(MAX_NEW), "--prompt", PROMPT,
                        "--prompt", other, "--output-json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 1
    assert err.splitlines()[-1].startswith("error: [ar] request 1 failed: non-finite logits after 0 generated tokens")
    assert out.count("--- request ") == 2 and "; failed: non-finite logits" in out.split("--- request 1")[1]
    doc = json.loads(path.read_text())
    assert [(r["status"], r["tokens"]) for r in doc["requests"]] == [("ok", reference.tokens), ("failed", [])]
    assert doc["metrics"]["failed_requests"] == [1] and doc["interrupted"] is False


# ---- interrupts --------------------------------------------------------------------------------------------


def test_pacer_adapts_the_call_length():
    pacer = Pacer(1, 0.25)
    assert pacer.limit(10) == 11
    pacer.update(1, 0.001)  # fast iterations: at most doubling per call
    assert pacer.steps == 2
    for _ in range(20):
        pacer.update(pacer.steps, pacer.steps * 0.01)
    assert pacer.steps == 25  # 0.25 s at 10 ms per iteration
    pacer.update(25, 25 * 0.2)  # iterations grew slow: at once down to the target
    assert pacer.steps == 1
    pacer.update(0, 0.1)  # nothing ran (every sequence already done): no new estimate
    assert pacer.steps == 1
    assert Pacer(None, None).limit(10) == 2**31 - 1 and Pacer(None, 0.5).steps == 1
    with pytest.raises(InputError, match=r"^seconds_per_call must be None or > 0, got 0"):
        Pacer(1, 0)


def _polls(*answers):
    """A `stop` that answers these in turn."""
    answers = iter(answers)
    return lambda: next(answers)


def test_stop_ends_decoding_with_the_tokens_so_far():
    engine = tiny_engine()
    batch = prompts([30, 40], engine.config.vocab_size, seed=11)
    full = engine.generate(batch, VEGAS).requests
    result = engine.generate(batch, VEGAS, steps_per_call=2, stop=_polls(False, True))
    assert [r.status for r in result.requests] == ["interrupted"] * 2
    assert result.metrics["interrupted_requests"] == [0, 1]
    for got, want in zip(result.requests, full):
        assert 1 < len(got.tokens) < len(want.tokens) and got.tokens == want.tokens[: len(got.tokens)]
        assert got.reason == f"stopped after {len(got.tokens)} generated tokens, before it finished"
    # serve: asked before each admission and call; the queued request never starts.
    served = engine.serve(batch + batch[:1], VEGAS, slots=2, refill=2, steps_per_call=2, stop=_polls(False, True))
    assert [r.status for r in served.requests] == ["interrupted"] * 3 and served.requests[2].tokens == []
    for got, want in zip(served.requests, full):
        assert 1 < len(got.tokens) < len(want.tokens) and got.tokens == want.tokens[: len(got.tokens)]


def test_sigint_keeps_the_finished_requests(monkeypatch, tmp_path, capsys, reference):
    """With --slots 1, SIGINT once request 0 has finished: it is written as it is, the queued ones as interrupted."""

    def progress(self, stage, done, total):
        if stage == "requests" and done == 1:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(generate._Progress, "__call__", progress)
    path = tmp_path / "out.json"
    rc = generate.main([*BASE, "--prompt", PROMPT, "--prompt", "Once upon a time", "--prompt", "Lorem ipsum",
                        "--slots", "1", "--output-json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 130
    assert err.splitlines()[2:] == [f"interrupted (SIGINT): 1 of 3 requests finished, written to {path}"]
    partial = "generated; interrupted, partial text: stopped after 0 generated tokens, before it finished) ---\n\n"
    assert out.startswith(f"--- request 0 ({reference.prompt_tokens} prompt tokens, {MAX_NEW} generated) ---\n"
                          f"{reference.text}\n--- request 1 (") and out.count(partial) == 2
    doc = json.loads(path.read_text())
    assert doc["interrupted"] is True and doc["metrics"]["interrupted_requests"] == [1, 2]
    assert [(r["status"], r["tokens"]) for r in doc["requests"]] == [
        ("ok", reference.tokens), ("interrupted", []), ("interrupted", [])
    ]
    assert os.listdir(tmp_path) == ["out.json"]  # no temporary file left behind


def test_sigint_without_output_json_prints_the_partial_text(monkeypatch, capsys, engine, reference):
    """SIGINT after the first decode call: the tokens decoded so far are printed, marked partial, and the exit is
    130."""

    def progress(self, stage, done, total):
        if stage == "decode":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(generate._Progress, "__call__", progress)
    rc = generate.main([*BASE, "--prompt", PROMPT])
    out, err = capsys.readouterr()
    header = re.match(r"--- request 0 \((\d+) prompt tokens, (\d+) generated; interrupted, partial text: stopped "
                      r"after (\d+) generated tokens, before it finished\) ---\n", out)
    assert rc == 130 and header, out
    n = int(header[2])
    assert 1 < n == int(header[3]) < MAX_NEW and int(header[1]) == reference.prompt_tokens
    assert out[header.end():] == engine.tokenizer.decode(reference.tokens[:n]) + "\n"
    assert err.splitlines()[2:] == ["interrupted (SIGINT): 0 of 1 requests finished"]


def test_json_is_never_half_written(monkeypatch, tmp_path):
    """Interrupted between writing and renaming, the file keeps its old content and no temporary file is left."""
    path = tmp_path / "out.json"
    path.write_text("old")

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_json(path, {"new": 1})
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def test_sigint_stops_a_cli_run_within_seconds(tmp_path):
    """A real SIGINT to `python -m vegas_jax.generate` once it prints tokens: 64 requests x 2,000 tokens (the
    fixture without its stop tokens, which this random model emits within a few hundred) would decode for 15 s or
    more. Exit 130 with no request finished, within seconds (10 allowed: a loaded 2-core CI machine finishes the
    decode call under way first), one line, and a JSON of what it generated."""
    model = Path(shutil.copytree(FIXTURE, tmp_path / "no-eos"))
    no_stop = {"tokenizer_config.json": {"eos_token": None}, "generation_config.json": {"eos_token_id": []}}
    for name, change in no_stop.items():
        (model / name).write_text(json.dumps(json.loads((model / name).read_text()) | change))
    path = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "vegas_jax.generate", "--model", str(model), "--dtype", "float32", "--quiet",
           "--max-model-len", "2048", "--max-new-tokens", "2000", "--stream", "--output-json", str(path),
           *["--prompt", PROMPT] * 64]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(120, proc.kill)
    guard.start()
    try:
        assert proc.stdout.readline().startswith("[")  # decoding has begun
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        guard.cancel()
        proc.kill()
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert lines[0].startswith("config: ") and lines[1].startswith("loaded ")
    assert lines[2:] == [f"interrupted (SIGINT): 0 of 64 requests finished, written to {path}"]
    assert elapsed < 10
    doc = json.loads(path.read_text())
    assert doc["interrupted"] is True and {r["status"] for r in doc["requests"]} == {"interrupted"}
    lengths = {len(r["tokens"]) for r in doc["requests"]}
    assert len(lengths) == 1 and 0 < lengths.pop() < 2000  # same prompt, same tokens: one length


@pytest.mark.parametrize("stream", [False, True])
def test_a_reader_that_closes_early_ends_the_run_quietly(tmp_path, stream):
    """`python -m vegas_jax.generate ... | head -1`: here the reader closes before the first byte is written, so
    every write to stdout fails (EPIPE). The run still finishes, --compare-ar included, and writes its JSON; no
    traceback; exit 141 (128 + SIGPIPE, what a shell reports for a writer killed by it)."""
    path = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "vegas_jax.generate", *BASE, "--method", "vegas", "--gamma", "2", "--prompt", PROMPT,
           "--compare-ar", "--output-json", str(path), *(["--stream"] if stream else [])]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    try:
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
    assert "speedup vs ar" in err  # what follows the text on stderr was not cut short
    doc = json.loads(path.read_text())
    assert doc["interrupted"] is False and doc["requests"][0]["status"] == "ok" and "ar" in doc
