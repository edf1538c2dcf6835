"""Plots of the benchmark suite's records (matplotlib, `pip install -e '.[bench]'`): tokens/s against batch per
method with min-max bars, τ and acceptance by draft position (summarise's), one plot per task family of the same,
where an iteration's time goes, and the memory roofline fraction at 8B shapes with the throughput projected at
SmolLM2's τ. Each function writes one PNG and returns its path, or None when the records hold nothing for it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import suite_tables as tables  # noqa: E402
from benchmarks.task_families import FAMILIES  # noqa: E402

METHOD_ORDER = ("ar", "vegas", "streaming", "quest", "retrieval", "ngram", "vegas-all", "last")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(records: list[dict], path: Path) -> Path | None:
    rows = tables.heldout_rows(records, temperature=0.0, tuned=True)
    lengths = sorted({r["prompt_tokens"] for r in rows}, reverse=True)
    if not lengths:
        return None
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for i, method in enumerate(METHOD_ORDER):
            points = sorted(((r["batch"], r) for r in rows if r["prompt_tokens"] == length and r["method"] == method),
                            key=lambda p: p[0])
            if not points:
                continue
            batches = [b * 2 ** (0.05 * (i - 3)) for b, _ in points]  # side by side, so the bars do not overlap
            median = [r["decode_tokens_per_s"] for _, r in points]
            low = [m - r["decode_tokens_per_s_min"] for m, (_, r) in zip(median, points)]
            high = [r["decode_tokens_per_s_max"] - m for m, (_, r) in zip(median, points)]
            ax.errorbar(batches, median, yerr=[low, high], marker="o", capsize=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s (median, min-max bars)")
        ax.set_title(f"held-out, {length}-token prompts, greedy, each tuned", fontsize=10)
        ax.legend(fontsize=8)
    return _save(fig, path)


def acceptance(records: list[dict], path: Path) -> Path | None:
    rows = [r for r in tables.heldout_rows(records, temperature=0.0) if r["method"] != "ar"]
    if not rows:
        return None
    length = max(r["prompt_tokens"] for r in rows)
    batch = max(r["batch"] for r in rows if r["prompt_tokens"] == length)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    tuned = [r for r in rows if r.get("tuned") and r["prompt_tokens"] == length]
    batches = sorted({r["batch"] for r in tuned})
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in tuned)]
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        tau = {r["batch"]: r["tau"] for r in tuned if r["method"] == method}
        left.bar([j + i * width for j, b in enumerate(batches) if b in tau], [tau[b] for b in batches if b in tau],
                 width, label=method)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"B{b}" for b in batches])
    left.set_ylabel("τ (tokens per iteration)")
    left.set_title(f"τ at each method's tuned cell, {length}-token prompts, greedy", fontsize=10)
    left.legend(fontsize=8)
    defaults = [r for r in rows if r.get("default") and r["prompt_tokens"] == length and r["batch"] == batch]
    for r in sorted(defaults, key=lambda r: METHOD_ORDER.index(r["method"])):
        rates = r["acceptance_by_position"]
        right.plot(range(1, len(rates) + 1), rates, marker="o", label=r["method"])
    right.set_xlabel("draft position")
    right.set_ylabel("acceptance rate")
    right.set_ylim(0, 1.02)
    right.set_title(f"acceptance by position at the common default (γ 6, 7 %), B{batch}", fontsize=10)
    right.legend(fontsize=8)
    return _save(fig, path)


def family(records: list[dict], name: str, path: Path) -> Path | None:
    """One task family at its longest prompts: tokens/s against batch per method (tuned, min-max bars), τ per
    method and batch, and acceptance by draft position at the largest batch (tuned cells)."""
    rows = tables.heldout_rows(records, temperature=0.0, tuned=True, family=name)
    if not rows:
        return None
    length = max(r["prompt_tokens"] for r in rows)
    rows = [r for r in rows if r["prompt_tokens"] == length]
    batches = sorted({r["batch"] for r in rows})
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    color = {m: f"C{i}" for i, m in enumerate(METHOD_ORDER)}  # one colour per method in all three panels
    fig, (rates, taus, accepted) = plt.subplots(1, 3, figsize=(17, 4.4))
    drafting = [m for m in methods if m != "ar"]
    width = 0.8 / max(1, len(drafting))
    for i, method in enumerate(methods):
        points = sorted((r for r in rows if r["method"] == method), key=lambda r: r["batch"])
        median = [r["decode_tokens_per_s"] for r in points]
        rates.errorbar([r["batch"] * 2 ** (0.05 * (i - 3)) for r in points], median, marker="o", capsize=3,
                       yerr=[[m - r["decode_tokens_per_s_min"] for m, r in zip(median, points)],
                             [r["decode_tokens_per_s_max"] - m for m, r in zip(median, points)]], label=method,
                       color=color[method])
    for i, method in enumerate(drafting):
        tau = {r["batch"]: r["tau"] for r in rows if r["method"] == method}
        taus.bar([j + i * width for j, b in enumerate(batches) if b in tau], [tau[b] for b in batches if b in tau],
                 width, label=method, color=color[method])
    rates.set_xscale("log", base=2)
    rates.set_yscale("log")
    rates.set_xlabel("batch")
    rates.set_ylabel("decode tokens/s (median, min-max bars)")
    rates.set_title(f"{name}: held-out, {length}-token prompts, greedy, each tuned", fontsize=10)
    rates.legend(fontsize=8)
    taus.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"B{b}" for b in batches])
    taus.set_ylabel("τ (tokens per iteration)")
    taus.set_title(f"{name}: τ at each method's tuned cell", fontsize=10)
    taus.legend(fontsize=8)
    largest = max(batches)
    for r in sorted((r for r in rows if r["batch"] == largest and r["method"] != "ar"),
                    key=lambda r: METHOD_ORDER.index(r["method"])):
        rates_by_position = r["acceptance_by_position"]
        accepted.plot(range(1, len(rates_by_position) + 1), rates_by_position, marker="o", label=r["method"],
                      color=color[r["method"]])
    accepted.set_xlabel("draft position")
    accepted.set_ylabel("acceptance rate")
    accepted.set_ylim(0, 1.02)
    accepted.set_title(f"{name}: acceptance by position at the tuned cells, B{largest}", fontsize=10)
    accepted.legend(fontsize=8)
    return _save(fig, path)


def iteration_time(records: list[dict], path: Path) -> Path | None:
    rows = [r for r in tables.scale_rows(records) if r.get("profile")]
    if not rows:
        return None
    phases = ("draft", "verify, accept, select", "other")
    labels = [f"{r['model']}\n{r['context'] // 1024}K B{r['batch']}\n{r['method']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.6))
    bottom = [0.0] * len(rows)
    for phase in phases:
        ms = [r["profile"]["phases"].get(phase, 0.0) for r in rows]
        ax.bar(range(len(rows)), ms, 0.6, bottom=bottom, label=f"GPU: {phase}")
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.scatter(range(len(rows)), [r["ms_per_iteration"] for r in rows], color="black", marker="_", s=400,
               label="wall time per iteration", zorder=3)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms per iteration (plain step for ar)")
    ax.set_title("Where an iteration's time goes, random 8B-shaped weights (profiler)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def roofline(records: list[dict], path: Path) -> Path | None:
    plain = [r for r in tables.scale_rows(records) if r["method"] == "ar"]
    if not plain:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4))
    labels = [f"{r['model']}\n{r['context'] // 1024}K B{r['batch']}" for r in plain]
    bars = left.bar(range(len(plain)), [100 * r["roofline_fraction"] for r in plain], 0.6)
    for bar, r in zip(bars, plain):
        left.annotate(f"{r['ms_per_iteration']:.2f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=7)
    left.axhline(85, color="gray", linestyle=":", label="target at B8 (85 %)")
    left.axhline(75, color="gray", linestyle="--", label="target at B1 (75 %)")
    left.set_xticks(range(len(plain)), labels, fontsize=7)
    left.set_ylabel("% of the memory roofline")
    left.set_title("Plain decoding step: weights + KV bytes over measured read bandwidth", fontsize=10)
    left.legend(fontsize=8)
    projected = tables.projections(records)
    if projected:
        names = [f"{p['model']}\n{p['context'] // 1024}K B{p['batch']}" for p in projected]
        width = 0.27
        for offset, key, label in ((-width, "plain_tokens_per_s", "plain (measured)"),
                                   (0, "vegas_tokens_per_s", "Vegas (projection)"),
                                   (width, "streaming_tokens_per_s", "Stream (projection)")):
            right.bar([i + offset for i in range(len(projected))], [p.get(key) or 0 for p in projected], width,
                      label=label)
        right.set_xticks(range(len(projected)), names, fontsize=7)
        right.set_yscale("log")
        right.set_ylabel("tokens/s")
        right.set_title("PROJECTION: iteration times at 8B shapes x τ measured on SmolLM2", fontsize=10)
        right.legend(fontsize=8)
    return _save(fig, path)


def write_all(records: list[dict], folder: Path, prefix: str) -> dict[str, Path]:
    """Every plot the records allow: {name: path}; a task family's is named family-NAME."""
    written = {}
    for name, plot in (("throughput", throughput), ("acceptance", acceptance), ("iteration-time", iteration_time),
                       ("roofline", roofline)):
        out = plot(records, folder / f"{prefix}-{name}.png")
        if out is not None:
            written[name] = out
    for name in FAMILIES:
        out = family(records, name, folder / f"{prefix}-family-{name}.png")
        if out is not None:
            written[f"family-{name}"] = out
    return written
