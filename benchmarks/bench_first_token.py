"""How long a new user waits: the README's first command (an installed checkout; the part after `make install`)
run as it is, timed from the process's start to the first generated text on its stdout, and to its end.

    python benchmarks/bench_first_token.py --runs cold,warm

cold: an empty compilation cache folder (VEGAS_COMPILE_CACHE_DIR), a first run on a fresh machine; warm: the same
folder again, as the CLI's default cache leaves it for a user's second run. The command prints its settings and
the model it loaded on stderr and only the generated text on stdout, so the first byte there is the first token.
Issue 52's target: the first token within 30 s on the 2-core CPU machine.

Writes first-token-DATE-HHMMSS[-TAG].json to benchmarks/results/ (or --out): a rerun never replaces a result.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGET_S = 30.0
RUNS = ("cold", "warm")
# The CLI's summary line of each method: "[vegas] compile 2.56s  prefill 6.21s  decode 17.26s ..."
SUMMARY = re.compile(r"^\[(\S+)\] compile ([\d.]+)s\s+prefill ([\d.]+)s\s+decode ([\d.]+)s", re.M)


def readme_command(readme: Path = ROOT / "README.md") -> str:
    """The README's first shell command that runs vegas_jax.generate, without its `make install &&` prefix."""
    blocks = re.findall(r"```sh\n(.*?)```", readme.read_text(), re.S)
    for block in blocks:
        for line in block.splitlines():
            if "vegas_jax.generate" in line:
                return line.split("&&", 1)[1].strip() if line.startswith("make install") else line.strip()
    raise SystemExit(f"error: {readme}: no shell block runs vegas_jax.generate")


def timed_run(command: str, env: dict, cwd: Path = ROOT) -> dict:
    """Runs `command` in bash: seconds to the first byte of its stdout and to its end, its exit status, and the
    per-method compile / prefill / decode seconds its stderr reports."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first: list[float] = []
    stdout: list[bytes] = []

    def read_stdout():
        while chunk := os.read(proc.stdout.fileno(), 4096):
            if not first:
                first.append(time.perf_counter() - t0)
            stdout.append(chunk)

    reader = threading.Thread(target=read_stdout)
    reader.start()
    stderr = proc.stderr.read().decode(errors="replace")
    proc.wait()
    reader.join()
    end = time.perf_counter() - t0
    methods = {m: {"compile_s": float(c), "prefill_s": float(p), "decode_s": float(d)}
               for m, c, p, d in SUMMARY.findall(stderr)}
    return {"first_token_s": first[0] if first else None, "end_s": end, "exit_status": proc.returncode,
            "methods": methods, "stdout_chars": len(b"".join(stdout).decode(errors="replace")),
            "stderr_tail": stderr[-400:] if proc.returncode else None}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default="cold,warm", help=f"comma-separated, of {', '.join(RUNS)}, in order")
    p.add_argument("--command", help="the command to time (default: the README's first generate command)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.runs or any(r not in RUNS for r in args.runs) or args.runs.count("warm") > 1:
        p.error(f"--runs: comma-separated, of {', '.join(RUNS)} (got {','.join(args.runs) or 'none'})")
    check_writable("--out", args.out)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    command = args.command or readme_command()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    log = RecordLog(run_metadata(timed_command=command, target_first_token_s=TARGET_S, cpu_count=os.cpu_count()),
                    f"first-token-{stamp}{'-' + args.tag if args.tag else ''}.json", args.out)
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "compiled"
        for run in args.runs:
            if run == "cold":  # an empty cache folder for each cold run
                shutil.rmtree(cache, ignore_errors=True)
            env = {**os.environ, "VEGAS_COMPILE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            record = {"run": run, **timed_run(command, env)}
            record["first_token_within_target"] = (record["first_token_s"] is not None
                                                   and record["first_token_s"] <= TARGET_S)
            log.add(record)
            print(f"{run:5s} first token {record['first_token_s'] or float('nan'):6.1f} s, end {record['end_s']:6.1f}"
                  f" s, exit {record['exit_status']}"
                  + "".join(f"; {m}: compile {t['compile_s']:.1f} s, prefill {t['prefill_s']:.1f} s"
                            for m, t in record["methods"].items()), flush=True)
    log.finish(complete=True)
    print(f"wrote {args.out / log.name}")
    failed = [r["run"] for r in log.records if r["exit_status"]]
    if failed:
        print(f"error: the command failed in run(s) {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
