"""Convert a checkpoint (GGUF, Hugging Face folder, or the embedded SmolLM2) into a vegas-jax Orbax checkpoint.

    python -m vegas_jax.convert --model SRC --output DIR [--dtype bfloat16|float32] [--force]

The Orbax copy loads faster than its source: no dequantisation, renaming or transposing at load time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from models.config import UnsupportedModelError
from vegas_jax import inputs
from vegas_jax.cli.arguments import INTERRUPTED
from vegas_jax.loading import CheckpointError, load_model, where_and_why
from vegas_jax.loading.orbax_ckpt import save_orbax

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse would print the usage block and exit; we print one line and return 2 from main().
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m vegas_jax.convert", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, help="folder to write the Orbax checkpoint into")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="parameter dtype to store")
    p.add_argument("--force", action="store_true", help="write into a non-empty --output, replacing a checkpoint there")
    return p


def _check_output(output: Path, model: str | None, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise _UsageError(f"--output {output}: exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise _UsageError(f"--output {output}: exists and is not empty (pass --force to overwrite)")
    if model is not None and Path(model).exists() and output.resolve() == Path(model).resolve():
        raise _UsageError(f"--output {output}: is the --model folder itself")
    # Tried in the folder itself or, where it is still to be made, in the nearest folder above it that exists:
    # a refused run leaves no folder behind.
    nearest = next(folder for folder in (output.absolute(), *output.absolute().parents) if folder.exists())
    if not nearest.is_dir():
        raise _UsageError(f"--output {output}: {nearest} is not a directory")
    try:
        inputs.probe_writable(nearest / f".vegas-write-probe-{os.getpid()}")
    except OSError as e:
        raise _UsageError(f"--output {output}: cannot be written: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        output = Path(args.output)
        _check_output(output, args.model, args.force)
        start = time.perf_counter()
        try:
            loaded = load_model(args.model, DTYPES[args.dtype])
        except (CheckpointError, UnsupportedModelError) as e:
            raise _UsageError(f"--model {where_and_why(args.model, e)}") from None
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while loading: nothing written yet
        print("interrupted (SIGINT)", file=sys.stderr)
        return INTERRUPTED
    loaded_at = time.perf_counter()
    # A save cut short leaves no vegas_config.json (written last), so loading refuses what it wrote.
    try:
        save_orbax(loaded, output)
    except OSError as e:  # a full disk, say
        print(f"error: --output {output}: cannot be written: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted (SIGINT): {output} holds an incomplete checkpoint, which loading refuses; convert again "
              "(with --force)", file=sys.stderr)
        return INTERRUPTED
    done = time.perf_counter()
    n_params = sum(x.size for x in jax.tree.leaves(loaded.params))
    size_mib = sum(x.nbytes for x in jax.tree.leaves(loaded.params)) / 2**20
    print(
        f"wrote {output}: vegas_config.json, params/ ({n_params:,} {args.dtype} parameters, {size_mib:.1f} MiB), "
        f"tokenizer/\nfrom {loaded.source} ({loaded.format}): "
        f"load {loaded_at - start:.2f} s, save {done - loaded_at:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
