"""What the draft head gains from the prompt's rows, on a tiny model trained to copy (docs/draft-head.md).

    python benchmarks/bench_head_context.py                   # the documented run: about 4 minutes on a CPU
    python benchmarks/bench_head_context.py --smoke --out /tmp/hc   # 2 steps of each, tree 4x2: checks the script

The target is the tiny test model (qwen3, 2 layers, width 64, vocabulary 96, float32; its weights from seed 0) first
trained to copy: Adam (3e-3) on batches of 32 sequences of a random 20-token segment repeated, the loss on every
position after the first segment, so it learns induction. It then greedily continues each 64-token copy prompt by
32 tokens; the fraction of held-out generated tokens that continue the copy is recorded (`target_copies`; a warning
if below 0.99: the heads' numbers then measure no copying).

Two heads are trained (vegas_jax.train_draft_head, unroll 2, batch 8, learning rate 3e-3, seed 0) on the target's
greedy outputs of --prompts copy prompts: with `context_tokens` 0 (the head's context starts at the prompt's last
token) and with `context_tokens` = the prompt's length (the head also trains over the prompt's rows). Each is
measured on --held-out other copy prompts: top-1 agreement with the target by draft depth (the training loss's
metric, computing what decoding computes) and decoding τ (engine.generate, drafter head, chain 6x1 and tree 4x2;
decoding always prefills the head over the prompt's rows), and whether decoding with it gave the target's greedy
tokens. Every seed is fixed: the same command gives the same numbers on the same machine.

Writes benchmarks/results/head-context-<date>[-tag].json (or --out; and $OUT; --smoke: --out and $OUT only): the
command, device, jax version, date, settings, the copy-training losses, the target's copy fraction and per head its
training losses, held-out loss, agreement by depth and τ per tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import NoTextTokenizer  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.decoder import forward, init_params  # noqa: E402
from models.kv_cache import KVCache  # noqa: E402
from vegas_jax import train_draft_head as tdh  # noqa: E402
from vegas_jax.attention.dense import DenseAttention  # noqa: E402
from vegas_jax.loading.bundle import LoadedModel  # noqa: E402
from vegas_jax.loading.draft_head_checkpoint import load_head  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# tests/test_lossless_tiny.py's tiny_engine(weight_scale=1.0), spelled out so that the benchmark's numbers do not
# move with the tests' fixture.
TINY = ModelConfig(
    architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
    tie_word_embeddings=True, qk_norm=True,
)
SEGMENT = 20  # the repeated segment's length
COPY_BATCH, COPY_LEARNING_RATE = 32, 3e-3
TREES = ("6x1", "4x2")
HEAD = dict(batch=8, learning_rate=3e-3, unroll=2, generate_batch=64, seed=0)


def copy_rows(rng: np.random.Generator, n: int, length: int, segment: int) -> np.ndarray:
    """[n, length] int: each row a random segment (tokens 1 .. vocabulary - 1) repeated."""
    seg = rng.integers(1, TINY.vocab_size, (n, segment))
    return np.tile(seg, (1, -(-length // segment)))[:, :length]


def copy_prompts(n: int, seed: int, length: int, segment: int) -> list[list[int]]:
    return [r.tolist() for r in copy_rows(np.random.default_rng(seed), n, length, segment)]


def train_to_copy(params, steps: int, length: int, segment: int, log_every: int) -> tuple[dict, list[dict]]:
    """The target's params after `steps` Adam steps on copy sequences of `length` tokens (data seed 0), and the
    loss every log_every steps and at the last."""
    tx = optax.adam(COPY_LEARNING_RATE)

    @jax.jit
    def step(params, opt, tokens):
        def loss(p):
            b, w = tokens.shape
            logits, _, _ = forward(p, tokens, jnp.broadcast_to(jnp.arange(w), (b, w)),
                                   KVCache.create(TINY, b, w, jnp.float32), DenseAttention(), config=TINY)
            lp = jax.nn.log_softmax(logits[:, :-1], -1)
            return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[:, segment:])

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    opt, rng, losses = tx.init(params), np.random.default_rng(0), []
    for i in range(steps):
        params, opt, value = step(params, opt, jnp.asarray(copy_rows(rng, COPY_BATCH, length, segment)))
        if i % log_every == 0 or i == steps - 1:
            losses.append({"step": i + 1, "loss": float(value)})
            print(f"copy-training the target: step {i + 1}/{steps}, loss {float(value):.4f}", flush=True)
    return params, losses


def measure_head(engine: Engine, data: dict, held_out: dict, test_ids: list[list[int]], settings: tdh.Settings,
                 trees: tuple[str, ...], history_every: int) -> dict:
    """Trains a head with `settings` and measures it on the held-out prompts."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        record = tdh.train(engine, data, folder, settings, checkpoint_every=10**9, progress=False)
        head = load_head(folder, engine.config)
        engine.use_draft_head(folder)
    train_s = time.perf_counter() - t0
    tokens, generated = held_out["tokens"], held_out["generated"]
    evaluate = jax.jit(functools.partial(tdh.loss_and_metrics, model=engine.config,
                                         prompt_tokens=settings.prompt_tokens, unroll=settings.unroll,
                                         context_tokens=settings.context_tokens, placement=engine.placement))
    loss, metrics = evaluate(head, engine.model.params, jnp.asarray(tokens), jnp.asarray(generated))
    agreement = [float(a) for a in metrics["agreement"]]
    decoding = {}
    for tree in trees:
        result = engine.generate(test_ids, GenerationOptions(max_new_tokens=settings.new_tokens, draft_tree=tree,
                                                             drafter="head"))
        plain = [row[settings.prompt_tokens: settings.prompt_tokens + n].tolist()
                 for row, n in zip(tokens, generated)]
        decoding[tree] = {"tau": result.metrics["tau"], "acceptance_rate": result.metrics["acceptance_rate"],
                          "identical_to_plain": sum(r.tokens == p for r, p in zip(result.requests, plain)),
                          "sequences": len(test_ids)}
    history = record["history"]
    return {"context_tokens": settings.context_tokens, "steps": settings.steps, "train_s": train_s,
            "final_training_loss": history[-1]["loss"],
            "training_history": [h for h in history if h["step"] % history_every == 0 or h is history[-1]],
            "held_out_loss": float(loss), "agreement_by_depth": agreement,
            "expected_chain_tau": tdh.expected_chain_tau(agreement), "decoding": decoding}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copy-steps", type=int, default=1500, help="Adam steps training the target to copy")
    p.add_argument("--head-steps", type=int, default=400, help="optimizer steps of each head")
    p.add_argument("--prompts", type=int, default=128, help="copy prompts the heads train on (>= 8, the batch)")
    p.add_argument("--held-out", type=int, default=32, help="other copy prompts the heads are measured on")
    p.add_argument("--prompt-tokens", type=int, default=64, help="each prompt's length (> the segment's 20)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens the target continues each prompt by")
    p.add_argument("--smoke", action="store_true", help="a few steps of everything on small prompts (CPU)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    head_settings, trees = dict(HEAD), TREES
    if args.smoke:  # compiling is most of it: one tree, and one engine call per data set
        args.copy_steps, args.head_steps, args.prompts, args.held_out = 2, 2, 8, 4
        args.prompt_tokens, args.new_tokens = 24, 8
        head_settings["generate_batch"], trees = 8, TREES[1:]
    limits = (("--copy-steps", args.copy_steps, 1), ("--head-steps", args.head_steps, 1),
              ("--prompts", args.prompts, HEAD["batch"]), ("--held-out", args.held_out, 1),
              ("--prompt-tokens", args.prompt_tokens, SEGMENT + 1),
              ("--new-tokens", args.new_tokens, HEAD["unroll"] + 1))
    for flag, value, least in limits:
        if value < least:
            print(f"error: {flag} {value}: must be >= {least}", file=sys.stderr)
            return 2
    if args.prompt_tokens + args.new_tokens > TINY.max_position_embeddings:
        print(f"error: --prompt-tokens {args.prompt_tokens}: with --new-tokens {args.new_tokens} over the model's "
              f"{TINY.max_position_embeddings} positions", file=sys.stderr)
        return 2
    P, N = args.prompt_tokens, args.new_tokens
    t0 = time.perf_counter()

    params, copy_losses = train_to_copy(init_params(TINY, jnp.float32, 0), args.copy_steps, P + N, SEGMENT,
                                        log_every=max(1, args.copy_steps // 6))
    engine = Engine(LoadedModel(TINY, params, NoTextTokenizer(), "random", "random"))
    print(f"target trained to copy in {time.perf_counter() - t0:.0f} s", flush=True)

    base = tdh.Settings(prompts=args.prompts, prompt_tokens=P, new_tokens=N, steps=args.head_steps,
                        validation=0, **head_settings)  # its held-out prompts measure the heads
    train_ids, test_ids = copy_prompts(args.prompts, 1, P, SEGMENT), copy_prompts(args.held_out, 2, P, SEGMENT)
    print(f"the target's greedy continuations of {args.prompts} training and {args.held_out} held-out prompts",
          flush=True)
    data = tdh.make_data(engine, train_ids, base)
    held_out = tdh.make_data(engine, test_ids, dataclasses.replace(base, prompts=args.held_out))
    tokens = held_out["tokens"]
    copies = float(np.mean(tokens[:, P:] == tokens[:, P - SEGMENT: P - SEGMENT + N]))
    print(f"the target continues the copy on {copies:.3f} of held-out generated tokens", flush=True)
    if copies < 0.99:
        print(f"warning: the target copies {copies:.3f} of held-out tokens (< 0.99): the heads' numbers measure no "
              f"copying; give more --copy-steps", flush=True)

    heads = []
    for context in (0, P):
        settings = dataclasses.replace(base, context_tokens=context)
        print(f"head with context_tokens {context}: training {args.head_steps} steps", flush=True)
        r = measure_head(engine, data, held_out, test_ids, settings, trees,
                         history_every=max(1, args.head_steps // 16))
        heads.append(r)
        taus = ", ".join(f"{tree} {d['tau']:.2f}" for tree, d in r["decoding"].items())
        print(f"head with context_tokens {context}: trained in {r['train_s']:.0f} s; held-out loss "
              f"{r['held_out_loss']:.3f}, top-1 agreement by depth "
              f"{', '.join(f'{a:.3f}' for a in r['agreement_by_depth'])}; decoding τ {taus}", flush=True)

    meta = run_metadata()
    settings = {"model": {k: getattr(TINY, k) for k in ("architecture", "vocab_size", "hidden_size", "num_layers",
                                                        "num_heads", "num_kv_heads", "head_dim")},
                "dtype": "float32", "model_seed": 0, "segment": SEGMENT, "copy_steps": args.copy_steps,
                "copy_batch": COPY_BATCH, "copy_learning_rate": COPY_LEARNING_RATE, "copy_data_seed": 0,
                "head_steps": args.head_steps, "prompts": args.prompts, "held_out": args.held_out,
                "prompt_seeds": {"train": 1, "held_out": 2}, "prompt_tokens": P, "new_tokens": N,
                "head": head_settings, "trees": list(trees), "smoke": args.smoke}
    doc = {**meta, "settings": settings, "copy_training": copy_losses, "target_copies": copies,
           "heads": heads, "total_s": time.perf_counter() - t0}
    name = f"head-context-{meta['date'][:10]}" + (f"-{args.tag}" if args.tag else "") + ".json"
    save_results(doc, name, args.out or (None if args.smoke else RESULTS))
    print(f"\n{'context_tokens':>14} {'loss':>6} {'agreement by depth':>22} "
          + " ".join(f"{'τ ' + t:>7}" for t in trees))
    for r in heads:
        print(f"{r['context_tokens']:>14} {r['held_out_loss']:>6.3f} "
              f"{' '.join(f'{a:.3f}' for a in r['agreement_by_depth']):>22} "
              + " ".join(f"{r['decoding'][t]['tau']:>7.2f}" for t in trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
