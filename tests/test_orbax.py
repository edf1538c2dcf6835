"""Converting to Orbax through the CLI loses nothing: same parameters bit for bit, same tokenizer, same logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vegas_jax.convert
from vegas_jax.convert import main
from vegas_jax.loading import load_model
from vegas_jax.loading.hf import load_hf

from test_hf_loading import logits_for

FIXTURES = Path(__file__).parent / "fixtures"
TEXT = "Hello world! The full model verifies 42 draft tokens."
CHAT = [{"role": "user", "content": "Hello, how are you?"}]


def assert_identical_params(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_same_tokenizer(a, b) -> None:
    ids = a.encode(TEXT)
    assert b.encode(TEXT) == ids and b.decode(ids) == a.decode(ids)
    assert b.encode_chat(CHAT) == a.encode_chat(CHAT)
    assert (b.bos_id, b.eos_ids, b.add_bos, b.chat_template) == (a.bos_id, a.eos_ids, a.add_bos, a.chat_template)


def convert(capsys, *argv: str) -> None:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith("wrote ") and re.search(r"load \d+\.\d\d s, save \d+\.\d\d s", out)


def test_tiny_llama_round_trip(tmp_path, capsys):
    source = FIXTURES / "tiny-llama"
    out = tmp_path / "ckpt"
    convert(capsys, "--model", str(source), "--output", str(out), "--dtype", "float32")
    assert json.loads((out / "vegas_config.json").read_text())["dtype"] == "float32"

    original, restored = load_hf(source, jnp.float32), load_model(str(out), jnp.float32)
    assert restored.format == "orbax" and restored.config == original.config
    assert_identical_params(original.params, restored.params)
    assert_same_tokenizer(original.tokenizer, restored.tokenizer)
    ids = [original.tokenizer.encode(TEXT)]
    np.testing.assert_array_equal(logits_for(restored, ids)[0], logits_for(original, ids)[0])
    # A float32 checkpoint restored as bfloat16 is rounded exactly as a direct bfloat16 load rounds.
    assert_identical_params(load_hf(source, jnp.bfloat16).params, load_model(str(out), jnp.bfloat16).params)


@pytest.mark.slow
def test_embedded_smollm2_round_trip(tmp_path, capsys, monkeypatch):
    # The reference is the very model the CLI converted: one (slow) GGUF load instead of two.
    sources = []

    def load_and_keep(*args):
        sources.append(load_model(*args))
        return sources[-1]

    monkeypatch.setattr(vegas_jax.convert, "load_model", load_and_keep)
    out = tmp_path / "smollm2"
    convert(capsys, "--output", str(out))  # no --model: the embedded GGUF, stored as bfloat16

    (original,) = sources
    restored = load_model(str(out))
    assert original.format == "gguf" and restored.format == "orbax"
    assert restored.config == original.config
    assert_identical_params(original.params, restored.params)
    assert_same_tokenizer(original.tokenizer, restored.tokenizer)
    ids = [original.tokenizer.encode_chat(CHAT)]
    np.testing.assert_array_equal(logits_for(restored, ids)[0], logits_for(original, ids)[0])


def run_failing(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    return captured.err


def test_cli_rejects_missing_source(tmp_path, capsys):
    err = run_failing(capsys, "--model", str(tmp_path / "absent"), "--output", str(tmp_path / "out"))
    assert "--model" in err and "absent" in err and "no such file" in err
    assert not (tmp_path / "out").exists()


def test_cli_rejects_bad_dtype(tmp_path, capsys):
    err = run_failing(capsys, "--model", str(FIXTURES / "tiny-qwen2"), "--output", str(tmp_path), "--dtype", "float16")
    assert "--dtype" in err and "float16" in err


def test_cli_refuses_non_empty_output_unless_forced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    args = ["--model", str(FIXTURES / "tiny-qwen2"), "--output", str(out)]
    err = run_failing(capsys, *args)
    assert "--output" in err and "--force" in err and not (out / "vegas_config.json").exists()
    convert(capsys, *args, "--force")
    assert load_model(str(out), jnp.float32).format == "orbax"
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("output", ["/proc/vegas-ckpt", "/sys/vegas-ckpt"])
def test_cli_refuses_an_output_it_cannot_write_before_loading(capsys, monkeypatch, output):
    """A test write finds a folder that takes no file before the model is read."""
    monkeypatch.setattr(vegas_jax.convert, "load_model", lambda *_: pytest.fail("loaded before --output's check"))
    err = run_failing(capsys, "--model", str(FIXTURES / "tiny-qwen2"), "--output", output)
    assert err.startswith(f"error: --output {output}: cannot be written: ")


def test_cli_reports_a_failed_save_in_one_line(tmp_path, capsys, monkeypatch):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vegas_jax.convert, "save_orbax", full)
    out = tmp_path / "out"
    err = run_failing(capsys, "--model", str(FIXTURES / "tiny-qwen2"), "--output", str(out))
    assert err == f"error: --output {out}: cannot be written: No space left on device\n"


def test_cli_interrupted_while_loading_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(vegas_jax.convert, "load_model", interrupted)
    assert main(["--model", str(FIXTURES / "tiny-qwen2"), "--output", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == "interrupted (SIGINT)\n" and not (tmp_path / "out").exists()


def test_cli_interrupted_while_saving_says_the_checkpoint_is_incomplete(tmp_path, capsys, monkeypatch):
    def interrupted(loaded, folder):
        Path(folder).mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(vegas_jax.convert, "save_orbax", interrupted)
    out = tmp_path / "out"
    assert main(["--model", str(FIXTURES / "tiny-qwen2"), "--output", str(out)]) == 130
    assert capsys.readouterr().err == (f"interrupted (SIGINT): {out} holds an incomplete checkpoint, which loading "
                                       "refuses; convert again (with --force)\n")
