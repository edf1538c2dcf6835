"""Where the engine's arrays live and how its programs run on a device mesh.

A mesh has two axes: `data` splits the batch (sequences, and with them the KV cache and the decode state) and
`model` splits every layer's heads and MLP units (Megatron tensor parallelism, models.decoder.TensorParallel). The
logical axes that arrays declare (models.logical_axes) map onto them through `MESH_AXES`; nothing else in the
engine names a mesh axis.

Each compiled program (prefill chunk, bootstrap, decode loop, admission) runs as ONE `shard_map` over the mesh: a
program sees its shard of the parameters, cache and state, the kernels run unchanged on their local block, and the
only collectives are the ones written out: the row-parallel projections' sums and the selection scores' sums over
`model`, and the count of finished sequences over `data` that ends the loop. So the layout holds through the
`while_loop` by construction, nothing cache-sized ever crosses devices, and a pipeline that has a mesh passes it to
`vegas_jax.load(..., mesh=...)` and never writes `shard_map` itself.

`Placement`, one static (hashable) value, carries the attention backend and the mesh to every part that depends on
them: attention implementations, selection policies, the loop configuration and the engine.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.decoder import TensorParallel
from models.logical_axes import BATCH, HEADS, KV_HEADS, MLP, Axes, axes_of
from vegas_jax.inputs import InputError

DATA, MODEL = "data", "model"
MESH_AXES = {BATCH: DATA, HEADS: MODEL, KV_HEADS: MODEL, MLP: MODEL}


@dataclasses.dataclass(frozen=True)
class Placement:
    backend: str = "reference"  # pallas | interpret | reference (vegas_jax.attention.backend)
    mesh: Mesh | None = None  # axes `data` and `model`; None: one device, no shard_map
    scan_layers: bool = True  # the decoder's layers as one scanned body, or unrolled (models.decoder.forward)

    @property
    def uses_kernels(self) -> bool:
        return self.backend != "reference"

    @property
    def interpret(self) -> bool:
        return self.backend == "interpret"

    def shards(self, axis: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[axis]

    @property
    def data_shards(self) -> int:
        return self.shards(DATA)

    @property
    def model_shards(self) -> int:
        return self.shards(MODEL)

    @property
    def tensor_parallel(self) -> TensorParallel:
        return TensorParallel(MODEL, self.model_shards) if self.model_shards > 1 else TensorParallel()

    # ---- inside a program: collectives over the mesh axes (no-ops without a mesh) ---------------------------
    def mean_over_model(self, x):
        """The mean over all heads from each shard's mean over its own (every shard holds as many heads); a pytree
        is one collective."""
        if self.model_shards == 1:
            return x
        return jax.tree.map(lambda s: s / self.model_shards, jax.lax.psum(x, MODEL))

    def sum_over_data(self, x):
        return jax.lax.psum(x, DATA) if self.data_shards > 1 else x

    def max_over_data(self, x):
        return jax.lax.pmax(x, DATA) if self.data_shards > 1 else x

    def first_row(self, local_batch: int):
        """The global batch row of this program's first row."""
        return jax.lax.axis_index(DATA) * local_batch if self.data_shards > 1 else 0

    # ---- outside: shardings, programs, host transfers ---------------------------------------------------------
    def spec(self, axes: Axes) -> PartitionSpec:
        return PartitionSpec(*(MESH_AXES.get(name) if name else None for name in axes))

    def sharding(self, axes: Axes):
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec(axes))

    def shardings(self, axes_tree):
        return jax.tree.map(self.sharding, axes_tree)

    def program(self, fn: Callable, in_axes: tuple, out_axes) -> Callable:
        """fn, a program over one shard's arrays, as a function of global arrays laid out by the axes trees."""
        if self.mesh is None:
            return fn
        specs = lambda tree: jax.tree.map(self.spec, tree)
        # check_vma=False: pallas_call has no replication rule (jax-ml/jax #21855), and every cross-shard value
        # in these programs comes from an explicit collective.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=specs(in_axes), out_specs=specs(out_axes),
                             check_vma=False)

    def creator(self, fn: Callable, *args) -> Callable:
        """fn jitted to compute its result straight into its shards (never whole on one device), laid out by the
        logical axes of its output for these arguments (models.logical_axes.axes_of)."""
        if self.mesh is None:
            return jax.jit(fn)
        return jax.jit(fn, out_shardings=self.shardings(axes_of(jax.eval_shape(fn, *args))))

    def put(self, host: np.ndarray, axes: Axes, dtype=None) -> jax.Array:
        """A host array placed on the mesh: each device (of every process) receives only its slice."""
        host = np.asarray(host) if dtype is None else np.asarray(host).astype(dtype)
        if self.mesh is None:
            return jnp.asarray(host)
        return jax.make_array_from_callback(host.shape, self.sharding(axes), lambda index: host[index])

    def fetch(self, tree):
        """Host (numpy) copies of global arrays, also those spread over several processes' devices."""
        if self.mesh is None or jax.process_count() == 1:
            return jax.tree.map(np.asarray, tree)
        from jax.experimental import multihost_utils

        return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)

    def agreed(self, value):
        """Process 0's value (a bool, int or float) on every process. The host decisions that shape what every
        process runs next (how many iterations a decode call may run, whether to stop) come from each process's
        own clock and signals; were they to differ, one process would enter a program, and its collectives, that
        another never enters, and both would wait for ever."""
        if self.mesh is None or jax.process_count() == 1:
            return value
        from jax.experimental import multihost_utils

        return type(value)(multihost_utils.broadcast_one_to_all(np.asarray(value, np.float32)).item())

    def describe(self) -> str:
        if self.mesh is None:
            return f"one device ({jax.devices()[0].platform})"
        return (f"mesh data={self.data_shards},model={self.model_shards} over {self.mesh.devices.size} "
                f"{self.mesh.devices.flat[0].platform} devices in {jax.process_count()} process(es)")


def parse_mesh(text: str) -> dict[str, int]:
    """`data=D,model=M` (either may be left out: size 1) -> {"data": D, "model": M}; InputError naming --mesh."""
    sizes = {DATA: 1, MODEL: 1}
    seen = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not match:
            raise InputError("{mesh} {!r}: expected axis=size pairs such as data=2,model=4", text)
        name, size = match.group(1), int(match.group(2))
        if name not in sizes:
            raise InputError("{mesh} {!r}: unknown axis {!r} (axes: data, model)", text, name)
        if name in seen:
            raise InputError("{mesh} {!r}: axis {!r} given twice", text, name)
        if size < 1:
            raise InputError("{mesh} {!r}: axis {!r} must have size >= 1", text, name)
        seen.add(name)
        sizes[name] = size
    return sizes


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """A (data, model) mesh over all devices (of every process); InputError naming --mesh if the sizes do not
    multiply to their number."""
    devices = jax.devices() if devices is None else devices
    count = sizes[DATA] * sizes[MODEL]
    if count != len(devices):
        raise InputError("{mesh} data={},model={}: {} devices, but {} are available ({})", sizes[DATA],
                         sizes[MODEL], count, len(devices), devices[0].platform)
    # Model-parallel neighbours (whose collectives run every layer) adjacent in device order, which on a GPU host
    # is NVLink order; data shards only meet once per iteration.
    grid = np.asarray(devices, dtype=object).reshape(sizes[DATA], sizes[MODEL])
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def adopt_mesh(mesh: Mesh | str) -> Mesh:
    """A caller's mesh as the engine uses it: axes `data` and `model` (a missing one gets size 1), Auto axis types
    (the engine lays out every array itself; Explicit types would make its host-side indexing a type error). A
    string is --mesh's `data=D,model=M`, over all devices."""
    if isinstance(mesh, str):
        return make_mesh(parse_mesh(mesh))
    if not isinstance(mesh, Mesh):
        raise InputError("{mesh} must be a jax.sharding.Mesh, a string such as 'data=2,model=4', or None, got {!r} "
                         "({})", mesh, type(mesh).__name__)
    names = tuple(mesh.axis_names)
    unknown = [n for n in names if n not in (DATA, MODEL)]
    if unknown:
        raise InputError("{mesh}: unknown axis {!r}; the engine's mesh has axes 'data' and 'model'", unknown[0])
    sizes = {DATA: 1, MODEL: 1} | {n: mesh.shape[n] for n in names}
    grid = np.asarray(mesh.devices).transpose([names.index(n) for n in (DATA, MODEL) if n in names])
    return Mesh(grid.reshape(sizes[DATA], sizes[MODEL]), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def check_model_fits(config: ModelConfig, placement: Placement) -> None:
    """InputError naming --mesh when the model axis does not split this model's heads and MLP evenly.

    KV heads are split, never replicated: with more model shards than KV heads each KV head would be stored and
    read on several devices (vLLM and tpu-inference replicate; MaxText refuses). For the models this engine targets
    (8 KV heads for Llama-3.1-8B and Qwen3-8B) every model axis up to 8 divides; SmolLM2's 3 KV heads allow 1 or 3.
    """
    m = placement.model_shards
    for what, count in (("KV heads", config.num_kv_heads), ("query heads", config.num_heads),
                        ("MLP units", config.intermediate_size)):
        if count % m:
            raise InputError(
                "{mesh} model={}: the model's {} {} do not split evenly over {} devices (it has {} query / {} KV "
                "heads; a model axis must divide the KV heads)",
                m, count, what, m, config.num_heads, config.num_kv_heads,
            )


def round_up_to_shards(batch: int, placement: Placement) -> int:
    return math.ceil(batch / placement.data_shards) * placement.data_shards


def on_all_shards(axes_tree: Any) -> Any:
    """The same layout with the batch axis whole on every data shard (what admission reads the joining rows as)."""
    return jax.tree.map(lambda axes: axes.replace(BATCH, None), axes_tree)
