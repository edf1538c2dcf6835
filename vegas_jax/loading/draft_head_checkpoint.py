"""A draft head's checkpoints (models.draft_head): an Orbax CheckpointManager folder of training steps, each with
the head's params, the optimizer state and a JSON record (the target it was trained for, the training settings and
the loss / acceptance history), so training resumes from the newest step and decoding loads the newest params.
`export` writes a head to ship: the newest step's params in bfloat16 and its record, without the optimizer state
(a third of the size of the float32 params, a ninth of a training step's checkpoint), which decoding loads as it
loads a training folder and training refuses to resume.

Beside the steps, TOKEN_COUNTS counts each token id in the sequences the head was trained on: a draft vocabulary
(models.draft_head.vocabulary_readout) is the most frequent of them (`ranked_tokens`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models import draft_head
from models.config import ModelConfig
from vegas_jax.inputs import InputError
from vegas_jax.loading import cause
from vegas_jax.loading.orbax_ckpt import pending_reads_drained

# The heads shipped for the embedded SmolLM2, one per attention it runs under (vegas_jax.attention.family's
# ATTENTION_CHOICES), each exported from `python -m vegas_jax.train_draft_head --attention A` at its defaults
# (docs/draft-head.md says how they were trained and measured).
EMBEDDED_HEADS = Path(__file__).parent / "embedded_heads"
TOKEN_COUNTS = "token_counts.npz"
KEEP = 2  # steps kept: the newest, and the one before in case the newest was cut off while written


def manager(folder: str | Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(Path(folder).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=KEEP))


def target_record(config: ModelConfig) -> dict:
    """What a head must match in its target: the shapes it reads and writes."""
    return {"architecture": config.architecture, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim}


def save(checkpoints: ocp.CheckpointManager, step: int, params, opt_state, record: dict) -> None:
    checkpoints.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                   opt_state=ocp.args.StandardSave(opt_state),
                                                   record=ocp.args.JsonSave(record)))
    checkpoints.wait_until_finished()


@contextlib.contextmanager
def _reading(flag: str, folder: Path, step: int):
    """Any failure of the reads inside (a missing item, a corrupt data file or record) becomes one InputError naming
    `flag` and the step; Orbax's other reads still in flight are finished first (orbax_ckpt.pending_reads_drained)."""
    try:
        with pending_reads_drained():
            yield
    except Exception as e:
        raise InputError("{%s} {}: cannot read the head checkpoint's step {}: {}" % flag, str(folder), step,
                         cause(e)) from e


def restore(checkpoints: ocp.CheckpointManager, params_like, opt_state_like):
    """(step, params, opt_state, record) of the newest step, or None when the folder holds none; InputError naming
    out for an exported head, which has no optimizer state to resume from."""
    step = checkpoints.latest_step()
    if step is None:
        return None
    if not (checkpoints.directory / str(step) / "opt_state").exists():
        raise InputError("{out} {}: holds an exported head (no optimizer state to resume from); train into another "
                         "folder", str(checkpoints.directory))
    abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
    with _reading("out", checkpoints.directory, step):
        restored = checkpoints.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(params_like)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
            record=ocp.args.JsonRestore()))
    return step, restored["params"], restored["opt_state"], restored["record"]


def check_target(record: dict, config: ModelConfig, where: str) -> None:
    if record.get("target") != target_record(config):
        raise InputError("{draft_head} {}: trained for a target with {}, this model has {}", where,
                         record.get("target"), target_record(config))


def _newest(folder: str | Path) -> tuple[ocp.CheckpointManager, int, dict]:
    """(manager, step, record) of the newest step of the head checkpoint in `folder`; InputError naming draft_head
    when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError("{draft_head} {}: no such folder", str(folder))
    checkpoints = manager(folder)
    step = checkpoints.latest_step()
    if step is None:
        raise InputError("{draft_head} {}: holds no draft head checkpoint", str(folder))
    with _reading("draft_head", folder, step):
        record = checkpoints.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
    if not isinstance(record, dict):
        raise InputError("{draft_head} {}: the head checkpoint's step {} has a record that is no JSON object",
                         str(folder), step)
    return checkpoints, step, record


def _here(shape, dtype) -> jax.ShapeDtypeStruct:
    """An array to restore onto this process's first device: a checkpoint records the devices it was saved from
    (a GPU's, for the shipped heads), which Orbax would otherwise look for."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))


def load_head(folder: str | Path, config: ModelConfig, dtype=jnp.float32):
    """The newest params of the head checkpoint in `folder` for a target of `config`, in `dtype`; InputError naming
    draft_head when there is none or it was trained for another target."""
    checkpoints, step, record = _newest(folder)
    check_target(record, config, str(folder))
    like = jax.tree.map(lambda shape: _here(shape, jnp.float32), draft_head.param_shapes(config),
                        is_leaf=lambda x: isinstance(x, tuple))
    with _reading("draft_head", Path(folder), step):
        params = checkpoints.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(like)))["params"]
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def export(folder: str | Path, dest: str | Path, dtype=jnp.bfloat16) -> Path:
    """The newest params of the head checkpoint in `folder` (any target) in `dtype`, with its record and without
    the optimizer state, as a head checkpoint of one step in `dest`; InputError naming draft_head when `folder`
    holds none, naming export when `dest` already holds a checkpoint."""
    checkpoints, step, record = _newest(folder)
    target = manager(dest)
    if target.latest_step() is not None:
        raise InputError("{export} {}: already holds a head checkpoint", str(dest))
    with _reading("draft_head", Path(folder), step):
        with ocp.StandardCheckpointer() as reader:
            stored = reader.metadata(checkpoints.directory / str(step) / "params").item_metadata.tree
        like = jax.tree.map(lambda x: _here(x.shape, x.dtype), stored)
        params = checkpoints.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(like)))["params"]
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    target.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params), record=ocp.args.JsonSave(record)))
    target.wait_until_finished()
    counts = token_counts(folder)
    if counts is not None:
        save_token_counts(dest, counts)
    return Path(dest)


def save_token_counts(folder: str | Path, counts: np.ndarray) -> None:
    np.savez_compressed(Path(folder) / TOKEN_COUNTS, counts=np.asarray(counts, np.int64))


def token_counts(folder: str | Path) -> np.ndarray | None:
    """[V] int64: how often each token id occurs in the head's training sequences; None when `folder` has none."""
    path = Path(folder) / TOKEN_COUNTS
    if not path.exists():
        return None
    try:
        with np.load(path) as saved:
            return saved["counts"]
    except Exception as e:
        raise InputError("{draft_vocab}: cannot read {}: {}", str(path), cause(e)) from None


def ranked_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids of `counts` (int32, most frequent first; ties by id)."""
    return np.argsort(-np.asarray(counts), kind="stable")[:size].astype(np.int32)


def embedded_head(attention: str) -> Path:
    """The folder of the head shipped for the embedded SmolLM2 under `attention`; InputError naming attention when
    none was shipped for it."""
    folder = EMBEDDED_HEADS / attention
    if not folder.is_dir():
        raise InputError("{attention} {}: the embedded model ships draft heads for {} only; train one "
                         "(python -m vegas_jax.train_draft_head) and pass its folder", attention,
                         ", ".join(sorted(d.name for d in EMBEDDED_HEADS.iterdir() if d.is_dir())))
    return folder


def span(context_tokens: int, prompt_tokens: int, new_tokens: int) -> int:
    """The most positions a head row attends to when trained with these vegas_jax.train_draft_head.Settings: the
    prompt rows it runs over (at most all but the prompt's last) and the generated rows."""
    return min(context_tokens, prompt_tokens - 1) + new_tokens


def trained_span(folder: str | Path) -> int:
    """The most positions a row of the head in `folder` attended to in training (`span` of its settings), which
    decoding keeps as its window; 0 when the record has no settings."""
    settings = _newest(folder)[2].get("settings") or {}
    if "context_tokens" not in settings:
        return 0
    return span(settings["context_tokens"], settings["prompt_tokens"], settings["new_tokens"])
