import jax


def lower_for_h200(jitted, *args, **static):
    """Lowers through the Pallas Triton backend for an H200 on this CPU-only machine: the Pallas-level checks
    (power-of-two tensor sizes, supported primitives, dot shapes) run; Triton's own compilation does not."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        return jitted.trace(*args, **static).lower(lowering_platforms=("cuda",)).as_text()
