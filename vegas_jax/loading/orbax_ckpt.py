"""vegas-jax's own checkpoint format: parameters as an Orbax checkpoint, restored straight into device arrays.

A folder holds
    vegas_config.json  format name and version, ModelConfig.to_dict(), stored dtype, where it was converted from
    params/            Orbax (StandardCheckpointer) checkpoint of the parameter tree, layout of param_shapes(config)
    tokenizer/         Tokenizer.save output
It exists to load fast: no name mapping, transposes or dequantisation, just a parallel read into arrays.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models.config import ModelConfig, UnsupportedModelError
from models.decoder import param_axes, param_shapes
from models.logical_axes import HEADS
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.loading.checkpoint_files import CheckpointError, read_json_object
from vegas_jax.loading.placing import relayout
from vegas_jax.sharding import Placement, check_model_fits
from vegas_jax.loading.tokenizer import Tokenizer

CONFIG_FILE = "vegas_config.json"
FORMAT = "vegas-jax-orbax"
FORMAT_VERSION = 1


def save_orbax(loaded: LoadedModel, folder: str | Path) -> None:
    """Writes `loaded` into `folder` (created if needed), replacing any vegas-jax checkpoint already there. The
    checkpoint holds the one-device layout whatever mesh `loaded` is on (fused q/k/v heads in plain order)."""
    folder = Path(folder).absolute()  # Orbax requires absolute paths
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / CONFIG_FILE
    # vegas_config.json marks a complete checkpoint: drop it first and write it last, so an interrupted save is
    # never mistaken for a loadable one.
    config_path.unlink(missing_ok=True)
    shutil.rmtree(folder / "tokenizer", ignore_errors=True)
    loaded.tokenizer.save(folder / "tokenizer")
    params = loaded.on_mesh(None).params if loaded.model_shards > 1 else loaded.params
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(folder / "params", params, force=True)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": loaded.config.to_dict(),
        "dtype": np.dtype(loaded.params["embed"].dtype).name,
        "converted_from": {"source": loaded.source, "format": loaded.format},
    }
    config_path.write_text(json.dumps(meta, indent=2) + "\n")


def read_config(folder: Path) -> ModelConfig:
    path = folder / CONFIG_FILE
    meta = read_json_object(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint description")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {meta.get('format_version')!r}, this vegas-jax reads version {FORMAT_VERSION}"
        )
    try:
        return ModelConfig.from_dict(meta["config"])
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from e
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: invalid model config ({e!r})") from e


def load_orbax(folder: str | Path, dtype=jnp.bfloat16, mesh=None) -> LoadedModel:
    folder = Path(folder).absolute()
    config = read_config(folder)
    params_path = folder / "params"
    if not params_path.is_dir():
        raise CheckpointError(f"{params_path}: no such directory")
    placement = Placement(mesh=mesh)
    check_model_fits(config, placement)
    shards = placement.model_shards
    default = jax.sharding.SingleDeviceSharding(jax.config.jax_default_device or jax.local_devices()[0])

    def target(path, shape, axes):
        name = path[-1].key
        if shards > 1 and name in ("qkv_proj", "qkv_bias"):
            axes = axes.replace(HEADS, None)  # stored in plain head order: reordered for the shards below
        sharding = default if mesh is None else placement.sharding(axes)
        # Orbax casts to the target's dtype as it restores: one checkpoint serves every dtype.
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    shapes = param_shapes(config)
    target = jax.tree_util.tree_map_with_path(target, shapes, param_axes(shapes),
                                              is_leaf=lambda x: isinstance(x, tuple))
    try:
        with pending_reads_drained(), ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_path, target)
    except (ValueError, KeyError, OSError) as e:
        # Orbax appends whole TensorStore specs to its messages; the first line says what went wrong.
        reason = str(e).splitlines()[0][:300]
        raise CheckpointError(
            f"{params_path}: unreadable Orbax checkpoint or not matching {CONFIG_FILE} ({reason})"
        ) from e
    return LoadedModel(
        config=config,
        # Stored in the plain head order: reordered into the shards' blocks (a no-op on one model shard).
        params=relayout(params, config, 1, mesh) if shards > 1 else params,
        tokenizer=Tokenizer.from_hf_folder(folder / "tokenizer"),
        source=str(folder),
        format="orbax",
        mesh=mesh,
    )


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that cancels the tasks still pending on it, and waits for them, before it closes.

    Orbax restores all arrays through one asyncio.gather on an event loop of its own. When a read fails (a corrupt
    data file), gather raises at once and Orbax closes its loop with the other reads still in flight: their
    TensorStore callbacks then hit a closed loop ("Event loop is closed"), and their never-finished tasks are
    collected at interpreter exit, printing dozens of tracebacks (the last an ImportError about sys.meta_path)
    after the one line that reports the cause."""

    def close(self):
        pending = asyncio.all_tasks(self)
        for task in pending:
            task.cancel()
        if pending:
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return _DrainingLoop()


@contextlib.contextmanager
def pending_reads_drained():
    """Event loops created meanwhile (Orbax's) are _DrainingLoops. (Loop policies are deprecated from Python 3.14
    on; Orbax offers no other way to reach its loop.)"""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)
