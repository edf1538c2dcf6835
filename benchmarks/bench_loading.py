"""Peak host memory and time of loading a checkpoint onto one device or a mesh (one process per configuration).

    python benchmarks/bench_loading.py [--model PATH] [--dtype float32] --meshes "none;data=8;data=2,model=3"

Each configuration runs in a fresh subprocess with as many CPU devices as its mesh has (XLA_FLAGS), so its peak
resident set (ru_maxrss) is its own. On CPU devices the parameters' device buffers are host memory too: the peak counts the
loader's transient host arrays plus every device's copy of what it holds (replicated arrays once per device).
Prints a table; writes JSON to --out (and $OUT if set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(model: str | None, dtype: str, mesh: str | None) -> dict:
    """In this process: load, then report peak RSS and the bytes the parameters take on the devices."""
    import jax
    import jax.numpy as jnp

    from vegas_jax.loading import load_model
    from vegas_jax.sharding import make_mesh, parse_mesh

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    loaded = load_model(model, getattr(jnp, dtype), make_mesh(parse_mesh(mesh)) if mesh else None)
    jax.block_until_ready(loaded.params)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    leaves = jax.tree.leaves(loaded.params)
    logical = sum(x.nbytes for x in leaves)
    on_devices = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    return {"mesh": mesh or "one device", "devices": jax.device_count(), "dtype": dtype, "load_s": seconds,
            "peak_rss_bytes": peak, "rss_before_load_bytes": baseline, "param_bytes": logical,
            "param_bytes_on_all_devices": on_devices}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--meshes", default="none,data=8", help="';'-separated: none or data=D,model=M")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one configuration here
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.model, args.dtype, None if args.one == "none" else args.one)))
        return 0

    from benchmarks.results_io import check_writable, run_metadata, save_results

    check_writable("--out", args.out)

    from vegas_jax.sharding import parse_mesh

    records = []
    for mesh in args.meshes.split(";"):
        devices = 1 if mesh == "none" else parse_mesh(mesh)["data"] * parse_mesh(mesh)["model"]
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--dtype", args.dtype, "--one", mesh] + (["--model", args.model] if args.model else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        records.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(records[-1]), flush=True)
    meta = run_metadata(model=args.model or "embedded:SmolLM2-135M-Instruct", platform="cpu")
    save_results({**meta, "records": records}, f"loading-{datetime.date.today().isoformat()}.json", args.out)
    gib = 2**30
    print(f"\n{'mesh':16} {'dtype':8} {'load s':>7} {'peak RSS GiB':>12} {'params GiB':>10} {'on devices GiB':>14}")
    for r in records:
        print(f"{r['mesh']:16} {r['dtype']:8} {r['load_s']:7.2f} {r['peak_rss_bytes'] / gib:12.2f} "
              f"{r['param_bytes'] / gib:10.2f} {r['param_bytes_on_all_devices'] / gib:14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
