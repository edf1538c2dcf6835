"""What the command lines' arguments share: argparse's errors in one line, the dtype and mesh flags, the flag
that names a library argument, UTF-8 text files, the checkpoint behind --model, and the exit status of a SIGINT."""

from __future__ import annotations

import argparse
from pathlib import Path

from vegas_jax.inputs import InputError

DTYPES = ("auto", "bfloat16", "float32")
INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class OneLineErrors(argparse.ArgumentParser):
    """argparse prints its usage before an error; bad input here gets exactly one line."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def resolve_dtype(name: str):
    """(the dtype's name, the dtype) for --dtype: auto is bfloat16 on a GPU, float32 elsewhere."""
    import jax
    import jax.numpy as jnp

    if name == "auto":
        name = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return name, {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def mesh_of(args):
    """The mesh --mesh asks for, over all devices (None: one device)."""
    if args.mesh is None:
        return None
    from vegas_jax.sharding import make_mesh, parse_mesh

    return make_mesh(parse_mesh(args.mesh))


_FLAGS = {"prompts": "--prompt", "stop_token_ids": "--stop-token-id"}


def flag(name: str) -> str:
    """The flag for a library argument that an InputError names (every option is a flag of the same name)."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def read_text(path: Path, flag: str) -> str:
    """A text file's content, read as UTF-8, strictly (a leading byte-order mark dropped): a file that is not
    UTF-8 is refused, naming the first byte that is not, rather than read with replacement characters."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise InputError(flag + " {}: {}", path, e.strerror) from None
    except UnicodeDecodeError as e:
        raise InputError(flag + " {}: not UTF-8 text (byte {:#04x} at offset {}); files are read as UTF-8", path,
                         e.object[e.start], e.start) from None


def load_checkpoint(model: str | None, dtype, mesh, draft_weights: str):
    """The checkpoint, laid out on `mesh`, with the draft weights asked for; any failure to read it is an
    InputError `--model PATH: cause`."""
    from models.config import UnsupportedModelError
    from vegas_jax.loading import CheckpointError, load_model, where_and_why

    try:
        return load_model(model, dtype, mesh, draft_weights)
    except (CheckpointError, UnsupportedModelError) as e:
        raise InputError("--model {}", where_and_why(model, e)) from None

