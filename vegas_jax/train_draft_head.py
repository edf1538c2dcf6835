"""Trains a draft head (models.draft_head) for a model on the model's own outputs: `python -m
vegas_jax.train_draft_head --out FOLDER` (docs/draft-head.md).

Self-distillation: the engine decodes the tuning split's prompts greedily (benchmarks.prompt_splits; never the
held-out split, on which the head is measured), and the head learns, at every generated position, the target's own
next hidden state and next-token distribution. The head runs over the prompt's rows too, as in decoding (prefill
writes them, vegas_jax.decode.drafters.prefill_rows), so it learns to attend to the prompt: to copy from it. The
prompt rows it runs over learn too (head_loss: better drafts, measured on a tiny copying model); `context_tokens`
bounds how many prompt rows before each prompt's last the head runs over (the last ones), which bounds its
attention and its prompt rows' logits at long prompts.

Training-time test: decoding feeds the head its own predictions after the first draft, so the head is trained on
that too. Pass 0 reads the target's hidden states over the prompt's and the generated rows; pass j (over the
generated rows) reads pass j - 1's predictions shifted by one row and attends as a draft at depth j + 1 does: to
the verified rows (pass 0's, prompt included) up to j rows back, then to one row of each pass 1..j, its own draft
path.

A run checkpoints (Orbax, vegas_jax.loading.draft_head_checkpoint) every --checkpoint-every steps and before
--time-limit runs out, and resumes from its folder's newest step when run again with the same flags: a long
training fits commands of limited length. The generated data is kept in the folder (data.npz) and reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import draft_head
from models.config import ModelConfig
from models.decoder import forward
from vegas_jax.cli.arguments import OneLineErrors
from vegas_jax.loading import draft_head_checkpoint
from vegas_jax.attention.family import ATTENTION_CHOICES, family_of, with_attention
from vegas_jax.runtime.engine import Engine
from vegas_jax.runtime.memory import device_bytes
from vegas_jax.inputs import InputError
from vegas_jax.runtime.research_options import CAPACITY_ALIGN
from vegas_jax.sharding import Placement

DATA_FILE = "data.npz"
PLOT_FILE = "training.png"
FEATURE_WEIGHT = 0.1  # the hidden-state regression beside the distillation loss (EAGLE weighs them alike)


@dataclasses.dataclass(frozen=True)
class Settings:
    # Defaults for SmolLM2-135M on one GPU: 262K generated tokens (1024 of the tuning split's ~1.4K prompts of 1K
    # tokens), each seen ~30 times.
    prompts: int = 1024  # tuning prompts decoded for data
    prompt_tokens: int = 1024  # each prompt's length
    new_tokens: int = 256  # tokens generated per prompt (the rows trained on)
    steps: int = 2000  # optimizer steps in all (a resumed run continues to this many)
    batch: int = 16  # sequences per step
    learning_rate: float = 3e-4
    unroll: int = 3  # training-time-test passes after the teacher-forced one (drafts of depth 2 .. unroll + 1)
    # Prompt rows before each prompt's last that the head runs over (the last ones): all of a default prompt's.
    # Its attention costs [B, H, rows, rows] float32 for rows = context_tokens + new_tokens: 4K prompts need a
    # bound (`--dry-run` shows the plan).
    context_tokens: int = 1024
    seed: int = 0
    generate_batch: int = 64  # prompts per engine call while making the data
    # The data's last sequences, never trained on: the head's agreement on them at each checkpoint shows whether it
    # learns the target or memorises its data (each sequence is seen ~30 times at the defaults).
    validation: int = 64

    def check(self) -> None:
        """InputError naming the first setting out of range."""
        checks = [
            (self.prompts >= 1, "{prompts} must be >= 1, got {}", self.prompts),
            (self.prompt_tokens >= 2, "{prompt_tokens} must be >= 2, got {}", self.prompt_tokens),
            (self.new_tokens >= 2, "{new_tokens} must be >= 2, got {}", self.new_tokens),
            (self.steps >= 1, "{steps} must be >= 1, got {}", self.steps),
            (1 <= self.batch <= self.prompts, "{batch} must be in [1, {prompts}], got {}", self.batch),
            (0 < self.learning_rate < 1, "{learning_rate} must be in (0, 1), got {}", self.learning_rate),
            (0 <= self.unroll < self.new_tokens, "{unroll} must be in [0, {new_tokens}), got {}", self.unroll),
            (self.context_tokens >= 0, "{context_tokens} must be >= 0, got {}", self.context_tokens),
            (self.generate_batch >= 1, "{generate_batch} must be >= 1, got {}", self.generate_batch),
            (0 <= self.validation <= self.prompts - self.batch,
             "{validation} must be in [0, {prompts} - {batch}] (sequences left to train on), got {}", self.validation),
        ]
        for ok, template, *values in checks:
            if not ok:
                raise InputError(template, *values)

    def data_fields(self) -> dict:
        """What the generated data depends on: a resumed run must give the same."""
        return {k: getattr(self, k) for k in ("prompts", "prompt_tokens", "new_tokens")}


# ---- data ------------------------------------------------------------------------------------------------------
def make_data(engine, prompt_ids: list[list[int]], settings: Settings, progress=None) -> dict:
    """{tokens [S, P + N] int32 (prompt, then the greedy continuation, zeros after it), generated [S] int32}."""
    from vegas_jax.runtime.options import GenerationOptions

    lengths = {len(p) for p in prompt_ids}
    if lengths != {settings.prompt_tokens}:
        raise InputError("{prompts}: every prompt must be {prompt_tokens} ({}) long, got lengths {}",
                         settings.prompt_tokens, sorted(lengths))
    options = GenerationOptions(max_new_tokens=settings.new_tokens)
    width = settings.prompt_tokens + settings.new_tokens
    tokens = np.zeros((len(prompt_ids), width), np.int32)
    generated = np.zeros((len(prompt_ids),), np.int32)
    for start in range(0, len(prompt_ids), settings.generate_batch):
        group = prompt_ids[start : start + settings.generate_batch]
        group = group + [group[-1]] * (settings.generate_batch - len(group))  # one compiled batch size
        result = engine.generate(group, options)
        for i, request in enumerate(result.requests[: len(prompt_ids) - start]):
            row = start + i
            tokens[row, : settings.prompt_tokens] = prompt_ids[row]
            tokens[row, settings.prompt_tokens : settings.prompt_tokens + len(request.tokens)] = request.tokens
            generated[row] = len(request.tokens)
        if progress:
            progress(min(start + settings.generate_batch, len(prompt_ids)), len(prompt_ids))
    return {"tokens": tokens, "generated": generated}


def token_counts(data: dict, settings: Settings, vocab_size: int) -> np.ndarray:
    """[V]: how often each token id occurs in the sequences trained on (prompt and generated tokens; the held-back
    validation sequences left out), which a draft vocabulary ranks tokens by (draft_head_checkpoint.ranked_tokens)."""
    trained_on = len(data["tokens"]) - settings.validation
    ends = settings.prompt_tokens + data["generated"][:trained_on]
    seen = np.arange(data["tokens"].shape[1])[None, :] < ends[:, None]
    return np.bincount(data["tokens"][:trained_on][seen], minlength=vocab_size)


# ---- loss ------------------------------------------------------------------------------------------------------
def pass_visibility(context: int, rows: int, passes: int, j: int) -> np.ndarray:
    """What each row of pass j sees, the head's K/V laid out pass by pass: pass 0's context + rows rows (the last
    `context` prompt rows, then the generated ones), then `rows` rows of each later pass. Pass 0 ([context + rows,
    slots] bool) is causal; row r of pass j >= 1 ([rows, slots]) is a draft at depth j + 1: it sees pass 0's rows up
    to generated row r - j (the prompt's included), then row r - j + i of each pass i = 1..j."""
    verified = context + rows
    slot = np.arange(verified + (passes - 1) * rows)[None, :]
    if j == 0:
        return slot <= np.arange(verified)[:, None]
    r = np.arange(rows)[:, None]
    i, t = np.divmod(slot - verified, rows)
    return (slot <= context + r - j) | ((slot >= verified) & (i + 1 <= j) & (t == r - j + i + 1))


def target_pass(target, tokens, *, model: ModelConfig, prompt_tokens: int, context_tokens: int,
                placement: Placement):
    """What the head learns from, for tokens [B, P + N]: the target's last hidden states [B, P + N, D] and its
    next-token distributions at rows P - c .. P + N - 1 ([B, c + N, V], c the prompt rows the head trains on:
    head_loss), by one full-attention pass of the target (outside the differentiated function: no gradient reaches
    the target, nor its kernels)."""
    batch, width = tokens.shape
    family = family_of(model)
    first = prompt_tokens - min(context_tokens, prompt_tokens - 1)
    cache = family.create_cache(model, batch, -(-width // CAPACITY_ALIGN) * CAPACITY_ALIGN, target["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    logit_rows = jnp.broadcast_to(jnp.arange(first, width), (batch, width - first))
    logits, _, _, hidden = forward(target, tokens, positions, cache, family.full_attention(model, placement),
                                   config=model, logit_rows=logit_rows, with_hidden=True)
    return hidden, jax.nn.softmax(logits, axis=-1)


def loss_and_metrics(head, target, tokens, generated, *, model: ModelConfig, prompt_tokens: int, unroll: int,
                     context_tokens: int, placement: Placement):
    """(loss, {agreement [unroll + 1]: top-1 agreement of pass j with the target}) over a batch of tokens [B, P + N]
    of which the first P + generated[b] are real."""
    hidden, target_probs = target_pass(target, tokens, model=model, prompt_tokens=prompt_tokens,
                                       context_tokens=context_tokens, placement=placement)
    return head_loss(head, target, tokens, generated, hidden, target_probs, model=model, prompt_tokens=prompt_tokens,
                     unroll=unroll, context_tokens=context_tokens)


def head_loss(head, target, tokens, generated, hidden, target_probs, *, model: ModelConfig, prompt_tokens: int,
              unroll: int, context_tokens: int):
    """loss_and_metrics given the target pass (target_pass). Pass 0's prompt rows learn as its generated rows do
    (the target's next distribution and hidden state), in a term of their own: on the tiny copying model of
    docs/draft-head.md this raised the head's agreement at every depth once trained; the agreement reported is the
    generated positions', where decoding drafts."""
    batch, width = tokens.shape
    rows, passes = width - prompt_tokens, unroll + 1
    context = min(context_tokens, prompt_tokens - 1)  # prompt rows before position P - 1
    first = prompt_tokens - 1 - context  # pass 0's first row's position
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    prompt_probs, target_probs = target_probs[:, :context], target_probs[:, context:]
    target_choice = jnp.argmax(target_probs, axis=-1)
    wanted = normalized(hidden[:, prompt_tokens:])  # generated row r (position P - 1 + r) predicts the state at P + r
    slots = context + passes * rows
    k, v = draft_head.empty_cache(model, batch, slots, jnp.float32)
    total, agreement = 0.0, []
    for j in range(passes):
        if j == 0:  # the target's own hidden states, prompt rows and generated rows
            at = positions[:, first : width - 1]
            features, following = hidden[:, first : width - 1].astype(jnp.float32), tokens[:, first + 1 :]
            write = at - first
        else:  # the generated rows, each reading the previous pass's prediction a row before
            at = positions[:, prompt_tokens - 1 : width - 1]
            features = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))
            following = tokens[:, prompt_tokens:]
            write = at - (prompt_tokens - 1) + context + j * rows
        visible = jnp.broadcast_to(jnp.asarray(pass_visibility(context, rows, passes, j)), (batch, at.shape[1], slots))
        out, k, v = draft_head.features(head, target, model, features, following, at, k, v, write, visible)
        if j == 0 and context:  # prompt row i (position first + i) predicts the target at first + 1 + i
            prompt_out = out[:, :context]
            distill = -jnp.sum(prompt_probs * jax.nn.log_softmax(draft_head.logits(target, model, prompt_out), -1), -1)
            regress = jnp.mean(jnp.square(normalized(prompt_out) - normalized(hidden[:, first + 1 : prompt_tokens])),
                               axis=-1)
            total = total + jnp.mean(distill + FEATURE_WEIGHT * regress)
        out = out[:, -rows:]  # the generated rows' predictions
        logits = draft_head.logits(target, model, out)
        valid = (jnp.arange(rows)[None, :] >= j) & (jnp.arange(rows)[None, :] < generated[:, None])
        count = jnp.maximum(jnp.sum(valid), 1)
        distill = -jnp.sum(target_probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        regress = jnp.mean(jnp.square(normalized(out) - wanted), axis=-1)
        total = total + jnp.sum(jnp.where(valid, distill + FEATURE_WEIGHT * regress, 0.0)) / count
        agreement.append(jnp.sum(valid & (jnp.argmax(logits, axis=-1) == target_choice)) / count)
    return total / passes, {"agreement": jnp.stack(agreement)}


def normalized(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def optimizer(settings: Settings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.learning_rate, max(1, min(100, settings.steps // 10)),
                                                  settings.steps, settings.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))


# ---- training --------------------------------------------------------------------------------------------------
def train(engine, data: dict, folder: str | Path, settings: Settings, *, time_limit: float | None = None,
          checkpoint_every: int = 200, progress: bool = True) -> dict:
    """Trains (or resumes) the head in `folder` to settings.steps steps or until `time_limit` seconds have passed,
    checkpointing every `checkpoint_every` steps and at the end. Returns the checkpoint's record."""
    t0 = time.perf_counter()
    model, target = engine.config, engine.model.params
    tx = optimizer(settings)
    head = draft_head.init_params(model, jnp.float32, settings.seed)
    opt_state = tx.init(head)
    checkpoints = draft_head_checkpoint.manager(folder)
    record = {"target": draft_head_checkpoint.target_record(model), "settings": dataclasses.asdict(settings),
              "history": []}
    restored = draft_head_checkpoint.restore(checkpoints, head, opt_state)
    step = 0
    if restored is not None:
        step, head, opt_state, record = restored
        draft_head_checkpoint.check_target(record, model, str(folder))
        check_resumable(record["settings"], settings)
        record["settings"] = dataclasses.asdict(settings)  # steps may grow
    Path(folder).mkdir(parents=True, exist_ok=True)
    draft_head_checkpoint.save_token_counts(folder, token_counts(data, settings, model.vocab_size))

    taught = functools.partial(target_pass, model=model, prompt_tokens=settings.prompt_tokens,
                               context_tokens=settings.context_tokens, placement=engine.placement)
    loss_fn = functools.partial(head_loss, model=model, prompt_tokens=settings.prompt_tokens, unroll=settings.unroll,
                                context_tokens=settings.context_tokens)

    @jax.jit
    def update(head, opt_state, target, tokens, generated):  # target an argument: a constant XLA would fold
        hidden, probs = taught(target, tokens)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(head, target, tokens, generated, hidden,
                                                                           probs)
        updates, opt_state = tx.update(grads, opt_state, head)
        return optax.apply_updates(head, updates), opt_state, loss, metrics

    evaluate = jax.jit(functools.partial(loss_and_metrics, model=model, prompt_tokens=settings.prompt_tokens,
                                         unroll=settings.unroll, context_tokens=settings.context_tokens,
                                         placement=engine.placement))

    tokens, generated = data["tokens"], data["generated"]
    bar = _progress_bar(step, settings.steps, progress)
    while step < settings.steps:
        pick = batch_rows(settings, step, len(tokens))
        head, opt_state, loss, metrics = update(head, opt_state, target, jnp.asarray(tokens[pick]),
                                                jnp.asarray(generated[pick]))
        step += 1
        agreement = [round(float(a), 4) for a in metrics["agreement"]]
        record["history"].append({"step": step, "loss": round(float(loss), 5), "agreement": agreement})
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", top1=agreement[0])
        out_of_time = time_limit is not None and time.perf_counter() - t0 > time_limit
        if step % checkpoint_every == 0 or step == settings.steps or out_of_time:
            if settings.validation:
                record["history"][-1]["validation"] = validate(evaluate, head, target, tokens, generated, settings)
            draft_head_checkpoint.save(checkpoints, step, head, opt_state, record)
        if out_of_time:
            break
    bar.close()
    return record


def batch_rows(settings: Settings, step: int, sequences: int) -> np.ndarray:
    """The data rows of a step's batch: drawn from all but the last `validation` sequences, as a function of the
    seed and the step alone (a resumed run draws what it would have)."""
    return np.random.default_rng([settings.seed, step]).choice(sequences - settings.validation, settings.batch,
                                                               replace=False)


def validate(evaluate, head, target, tokens, generated, settings: Settings) -> dict:
    """{loss, agreement by depth} on the held-back sequences (the data's last `validation`), averaged over batches
    of the training batch's size (its compiled shape and memory); the last batch wraps around to the first
    held-back sequences."""
    held = np.arange(len(tokens) - settings.validation, len(tokens))
    batches = -(-len(held) // settings.batch)
    rows = np.resize(held, batches * settings.batch).reshape(batches, settings.batch)
    results = [evaluate(head, target, jnp.asarray(tokens[r]), jnp.asarray(generated[r])) for r in rows]
    return {"loss": round(float(np.mean([float(loss) for loss, _ in results])), 5),
            "agreement": [round(float(a), 4) for a in np.mean([m["agreement"] for _, m in results], axis=0)]}


def check_resumable(saved: dict, settings: Settings) -> None:
    for name, value in settings.data_fields().items() | {"unroll": settings.unroll, "batch": settings.batch,
                                                         "seed": settings.seed,
                                                         "context_tokens": settings.context_tokens,
                                                         "validation": settings.validation}.items():
        if saved.get(name, 0 if name == "validation" else None) != value:  # older checkpoints: trained on all
            raise InputError("{" + name + "} {}: the checkpoint was trained with {}; give that, or a new {out}",
                             value, saved.get(name))


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


def expected_chain_tau(agreement: list[float]) -> float:
    """τ of a chain as deep as the passes if each depth's acceptance were its pass's top-1 agreement (a proxy: the
    measured τ is the lead's, on held-out prompts)."""
    tau, reach = 1.0, 1.0
    for a in agreement:
        reach *= a
        tau += reach
    return tau


def plot(record: dict, path: Path) -> str:
    """Loss and per-depth agreement against steps into `path`; a note instead where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    history = record["history"]
    steps = [h["step"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, [h["loss"] for h in history])
    left.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    checked = [h for h in history if "validation" in h]
    for j in range(len(history[0]["agreement"])):
        line, = right.plot(steps, [h["agreement"][j] for h in history], label=f"draft depth {j + 1}")
        if checked:
            right.plot([h["step"] for h in checked], [h["validation"]["agreement"][j] for h in checked], "o--",
                       color=line.get_color(), label=f"depth {j + 1}, held-back sequences")
    right.set(xlabel="step", ylabel="top-1 agreement with the target", ylim=(0, 1), title="acceptance proxy")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


# ---- memory plan -----------------------------------------------------------------------------------------------
def memory_plan(model: ModelConfig, settings: Settings, target_bytes: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes on the device of one training step, by what holds them (the largest terms; XLA's own plan differs)."""
    head_params = sum(int(np.prod(s)) for s in jax.tree.leaves(draft_head.param_shapes(model),
                                                                is_leaf=lambda x: isinstance(x, tuple)))
    b, width, rows, passes = settings.batch, settings.prompt_tokens + settings.new_tokens, settings.new_tokens, \
        settings.unroll + 1
    verified = draft_head_checkpoint.span(settings.context_tokens, settings.prompt_tokens, rows)  # pass 0's rows
    slots = verified + (passes - 1) * rows
    capacity = -(-width // CAPACITY_ALIGN) * CAPACITY_ALIGN
    kv = 2 * model.num_layers * b * capacity * model.num_kv_heads * model.head_dim * dtype_bytes
    vocab_rows = b * rows * model.vocab_size * 4  # one float32 [B, N, V]
    prompt_vocab_rows = b * (verified - rows) * model.vocab_size * 4  # the prompt rows' (pass 0's)
    return {
        "target params": target_bytes,
        "head params, gradients, Adam moments (float32)": 4 * 4 * head_params,
        "target pass: KV cache and hidden states": kv + b * width * model.hidden_size * (4 + dtype_bytes),
        "target logits and probabilities (prompt rows too)": 2 * (vocab_rows + prompt_vocab_rows),
        "head logits, log-softmax and their gradients, every pass (pass 0's prompt rows too)":
            3 * (passes * vocab_rows + prompt_vocab_rows),
        "head K/V, scores and activations, every pass (pass 0 over prompt rows too)": b * slots * (
            4 * slots * model.num_heads + 16 * model.hidden_size + 8 * model.intermediate_size),
        "data (token ids, host)": settings.prompts * width * 4,
    }


# ---- command line ----------------------------------------------------------------------------------------------
SETTING_HELP = {
    "prompts": "tuning-split prompts decoded for the training data",
    "prompt_tokens": "each prompt's length in tokens",
    "new_tokens": "tokens generated per prompt (greedy): the positions trained on",
    "steps": "optimizer steps in all; a resumed run continues to this many",
    "batch": "sequences per step",
    "learning_rate": "AdamW's peak learning rate (warm-up, then cosine decay to a tenth)",
    "unroll": "training-time-test passes after the teacher-forced one: the head learns drafts of depth 2 .. "
              "unroll + 1 from its own predictions",
    "context_tokens": "prompt rows before each prompt's last that the head runs over in training (the last ones; "
                      "decoding runs it over the whole prompt): its attention costs float32 [batch, heads, rows, "
                      "rows] for rows = this + --new-tokens, so 4K prompts want a bound (see --dry-run)",
    "seed": "the head's initialisation and each step's batch",
    "generate_batch": "prompts per engine call while making the data",
    "validation": "the data's last sequences, never trained on: the head's top-1 agreement on them is measured at "
                  "each checkpoint (and plotted beside the training batches')",
}

def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="python -m vegas_jax.train_draft_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (.gguf, HF or vegas-jax Orbax folder); default: the "
                                                 "embedded SmolLM2-135M")
    p.add_argument("--out", required=True, help="checkpoint folder (resumed from when it holds one)")
    p.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                   help="train for the model attending so (nsa-view: a dense model's NSA view, which SSV decodes; "
                        "default: as the checkpoint does)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="the target's dtype (auto: bfloat16 on GPU, float32 on CPU); the head trains in float32")
    defaults = Settings()
    for field in dataclasses.fields(Settings):
        p.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name), help=SETTING_HELP[field.name])
    p.add_argument("--time-limit", type=float, default=540.0,
                   help="seconds (from the start, loading and making the data included) after which training "
                        "checkpoints and exits (run again to resume); 0: none")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--export", default=None, metavar="FOLDER",
                   help="after training, write the head to ship to FOLDER: its newest params in bfloat16 and its "
                        "record, without the optimizer state or the data (--draft-head loads it as it loads --out)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the memory plan and whether a step fits this device, then exit")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code
    try:
        return run(args)
    except InputError as e:
        print(f"error: {e.render(_flag)}", file=sys.stderr)
        return 2


def run(args) -> int:
    started = time.perf_counter()  # the time limit counts loading and making the data too
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    settings.check()
    if args.time_limit < 0:
        raise InputError("{time_limit} must be >= 0 (0: none), got {}", args.time_limit)
    if args.checkpoint_every < 1:
        raise InputError("{checkpoint_every} must be >= 1, got {}", args.checkpoint_every)
    folder = Path(args.out)
    if folder.exists() and not folder.is_dir():
        raise InputError("{out} {}: not a folder", args.out)
    export = Path(args.export) if args.export else None
    if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
        raise InputError("{export} {}: must be a new or empty folder", args.export)
    import vegas_jax

    engine = vegas_jax.load(args.model, args.dtype)
    engine = Engine(dataclasses.replace(engine.model, config=with_attention(engine.config, args.attention)))
    model = engine.config
    params = jax.tree.leaves(engine.model.params)
    plan = memory_plan(model, settings, sum(x.nbytes for x in params), params[0].dtype.itemsize)
    step_bytes = sum(v for k, v in plan.items() if "host" not in k)
    limit, source = device_bytes(engine.placement)
    if args.dry_run:
        for what, size in plan.items():
            print(f"{size / 2**20:12.1f} MiB  {what}")
        print(f"{step_bytes / 2**30:12.2f} GiB  per training step on the device, all together")
        print(f"{_generation_bytes(engine, settings) / 2**30:12.2f} GiB  making the data first (engine.plan of "
              f"{settings.generate_batch} prompts)")
        print(f"{limit / 2**30:12.2f} GiB  on this device ({source}): "
              f"{'fits' if step_bytes <= limit else 'does not fit'}")
        return 0
    # The plan counts the largest terms only and XLA's own may be smaller, so only a plan past the whole device is
    # refused, before the data (minutes of decoding) is made for a step that cannot run.
    if step_bytes > limit:
        raise InputError("{batch} / {new_tokens} / {context_tokens}: a training step needs {:.2f} GiB on the device "
                         "(the largest terms; --dry-run lists them) but it has {:.2f} GiB ({}): lower one of them",
                         step_bytes / 2**30, limit / 2**30, source)
    folder.mkdir(parents=True, exist_ok=True)
    data = load_or_make_data(engine, folder, settings, progress=not args.quiet)
    time_limit = max(0.0, args.time_limit - (time.perf_counter() - started)) if args.time_limit else None
    record = train(engine, data, folder, settings, time_limit=time_limit,
                   checkpoint_every=args.checkpoint_every, progress=not args.quiet)
    last = record["history"][-1] if record["history"] else None
    print(plot(record, folder / PLOT_FILE) if record["history"] else "no plot: no steps ran")
    if last is not None:
        print(f"step {last['step']}/{settings.steps}  loss {last['loss']:.4f}  top-1 agreement by depth "
              f"{last['agreement']}  (a chain's τ if acceptance were that: "
              f"{expected_chain_tau(last['agreement']):.2f})")
        if "validation" in last:
            held = last["validation"]
            print(f"held-back sequences ({settings.validation}, never trained on): loss {held['loss']:.4f}  top-1 "
                  f"agreement by depth {held['agreement']}  (τ proxy {expected_chain_tau(held['agreement']):.2f})")
    if last is None or last["step"] < settings.steps:
        print("time limit reached: run the same command again to resume")
    if args.export:
        exported = draft_head_checkpoint.export(folder, export)
        size = sum(f.stat().st_size for f in exported.rglob("*") if f.is_file())
        print(f"exported the head of step {last['step'] if last else '?'} to {exported} ({size / 2**20:.1f} MiB)")
    return 0


def _generation_bytes(engine, settings: Settings) -> int:
    from vegas_jax.runtime.options import GenerationOptions

    plan = engine.plan([[0] * settings.prompt_tokens] * settings.generate_batch,
                       GenerationOptions(max_new_tokens=settings.new_tokens))
    return int(plan["bytes_per_device"]["total"])


def load_or_make_data(engine, folder: Path, settings: Settings, progress: bool = True) -> dict:
    """The folder's data.npz when it was made for these settings, else a new one from the tuning split."""
    path = folder / DATA_FILE
    if path.exists():
        with np.load(path) as saved:
            made_for = json.loads(str(saved["settings"]))
            if made_for == settings.data_fields():
                return {"tokens": saved["tokens"], "generated": saved["generated"]}
        raise InputError("{out} {}: its data was made for {}, not {}; give those or a new {out}", str(folder),
                         made_for, settings.data_fields())
    from benchmarks.prompt_splits import split_prompts  # the tuning split only: held-out prompts measure the head

    prompt_ids = split_prompts(engine.tokenizer, "tuning", settings.prompts, settings.prompt_tokens).prompts
    bar = _progress_bar(0, len(prompt_ids), progress)
    bar.set_description("generate")
    data = make_data(engine, prompt_ids, settings, lambda done, _: bar.update(done - bar.n))
    bar.close()
    np.savez(path, settings=json.dumps(settings.data_fields()), **data)
    return data


if __name__ == "__main__":
    sys.exit(main())
