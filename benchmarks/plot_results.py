"""Plots of the committed end-to-end results: decode throughput (plain vs Vegas), where a Vegas iteration's GPU
time goes step by step of the optimisation (profiles), and τ per selection policy; and a timeline of continuous
batching's decode calls; prefill through XLA against the kernel.

    pip install -e '.[bench]' && python benchmarks/plot_results.py   # writes benchmarks/results/e2e-summary.png,
                                                                      # e2e-serve3-*.png and prefill-summary.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def load(tag: str) -> list[dict]:
    return [r for f in sorted(RESULTS.glob(f"e2e-*-{tag}.json")) for r in json.loads(f.read_text())["records"]]


# Profiles of one Vegas iteration (B = 64, 7.9K-token prompts, random SmolLM2-shaped weights but the last), in the order the
# optimisations landed: (file tag, label).
PROFILE_STEPS = [
    ("default", "XLA Triton\nGEMMs"),
    ("cublas", "+ cuBLAS\nGEMMs"),
    ("opt1", "+ kernel writes\nK/V, reads\nselections"),
    ("opt2", "+ packed\noperand,\n2 splits"),
    ("rope", "+ RoPE in\ndraft kernel"),
    ("s14-real-b64", "main 431f64f,\nreal weights"),
]
KINDS = ("pallas", "gemm", "xla_fusion", "copy")


def plot_profiles(ax) -> None:
    steps = []
    for tag, label in PROFILE_STEPS:
        path = RESULTS / f"profile-2026-11-30-{tag}.json"
        if path.exists():
            steps.append((label, json.loads(path.read_text())["methods"]["vegas"]))
    bottom = [0.0] * len(steps)
    for kind in KINDS:
        ms = [step["by_kind"].get(kind, {}).get("ms_per_iteration", 0.0) for _, step in steps]
        ax.bar(range(len(steps)), ms, 0.6, bottom=bottom, label=kind)
        bottom = [b + m for b, m in zip(bottom, ms)]
    for i, (_, step) in enumerate(steps):
        ax.annotate(f"{step['kernels_per_iteration']:.0f} kernels", (i, bottom[i]), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(range(len(steps)), [label for label, _ in steps], fontsize=8)
    ax.set_ylabel("GPU ms per Vegas iteration")
    ax.set_title("Where an iteration's GPU time goes (B=64, 7.9K)")
    ax.legend(fontsize=8)


def plot_serving(tag: str) -> Path:
    """Continuous batching, one bar per decode call: its tokens/s over the decode time it took, with the slots
    busy at its start; plain decoding's rate and twice it for reference."""
    records = {r["method"]: r for r in load(tag)}
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for method in ("ar", "vegas"):
        calls = records[method]["decode_calls"]
        edges = [0.0]
        for call in calls:
            edges.append(edges[-1] + call["seconds"])
        rates = [call["tokens"] / call["seconds"] for call in calls]
        ax.stairs(rates, edges, linewidth=2, label=f"{method}: {len(calls)} calls")
        for call, left, rate in zip(calls, edges, rates):
            if method == "vegas" and call["seconds"] > 0.05:
                ax.annotate(f"{call['busy_slots']} busy, {call['queued']} queued: {call['iterations']} iterations",
                            (left + call["seconds"] / 2, rate), ha="center", va="bottom", fontsize=8)
    plain = records["ar"]["decode_tokens_per_s"]
    ax.axhline(2 * plain, color="gray", linestyle=":", label="2x plain")
    r = records["vegas"]
    ax.set_xlabel("decode seconds (calls of the loop, admissions in between not shown)")
    ax.set_ylabel("tokens/s of the call")
    ax.set_title(f"Continuous batching, SmolLM2 on the H200: {r['requests']} requests of {r['prompt_tokens']} "
                 f"tokens through {r['batch']} slots, refill {r['refill']}: {r['speedup_vs_ar']:.2f}x whole run, "
                 f"{r['steady_speedup_vs_ar']:.2f}x steady", fontsize=9)
    ax.set_ylim(0, 2.25 * plain)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    out = RESULTS / f"e2e-{tag}.png"
    fig.savefig(out, dpi=110)
    return out


def plot_prefill() -> Path:
    """Prefill seconds per batch: XLA's dense attention against the verification kernel at two chunk sizes. The
    later file wins where both measured a configuration."""
    records = {}
    for name in ("prefill-2026-11-30-s12.json", "prefill-2026-11-30-s12b.json"):
        for r in json.loads((RESULTS / name).read_text())["records"]:
            records[(r["batch"], r["path"], r["chunk"])] = r
    batches = sorted({batch for batch, _, _ in records})
    runs = [("xla", 512, "XLA dense (chunk 512, 144 at B64)"), ("kernel", 512, "kernel, chunk 512"),
            ("kernel", 2048, "kernel, chunk 2048")]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for offset, (path, chunk, label) in zip((-0.27, 0, 0.27), runs):
        found = [(i, records[(b, path, chunk)]) for i, b in enumerate(batches) if (b, path, chunk) in records]
        bars = ax.bar([i + offset for i, _ in found], [r["prefill_s"] for _, r in found], 0.27, label=label)
        if path == "kernel":
            for bar, (_, r) in zip(bars, found):
                ax.annotate(f"{r['speedup_vs_xla']:.1f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"B{b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("prefill seconds (7,936-token prompts)")
    ax.set_title("Prefill on the H200, random SmolLM2-135M weights", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / "prefill-summary.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> int:
    throughput = load("s14-large") + load("s14-small")  # two runs of the same code
    policies = {"greedy": load("policies-greedy-logit"), "T=0.7": load("policies-t07-logit")}
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(19, 4.8), gridspec_kw=dict(width_ratios=[1.4, 1, 1]))

    # Prompts of one target length differ by a token or so from batch to batch: order by length class, then batch.
    configs = sorted({(r["prompt_tokens"], r["batch"]) for r in throughput}, key=lambda c: (round(c[0], -2), c[1]))
    labels = [f"{p / 1000:.1f}K x B{b}" for p, b in configs]
    for offset, method in [(-0.2, "ar"), (0.2, "vegas")]:
        rate = {(r["prompt_tokens"], r["batch"]): r["decode_tokens_per_s"] for r in throughput if r["method"] == method}
        bars = ax1.bar([i + offset for i in range(len(configs))], [rate[c] for c in configs], 0.4, label=method)
        if method == "vegas":
            speedups = {(r["prompt_tokens"], r["batch"]): r["speedup_vs_ar"] for r in throughput if r["method"] == method}
            for bar, c in zip(bars, configs):
                ax1.annotate(f"{speedups[c]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                             ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(configs)), labels, fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("decode tokens/s")
    ax1.set_title("SmolLM2-135M, H200: plain vs Vegas (γ=6, ratio 0.07)")
    ax1.legend()

    methods = [r["method"] for r in policies["greedy"] if r["method"] != "ar"]
    for offset, (name, records) in zip([-0.2, 0.2], policies.items()):
        tau = {r["method"]: r["tau"] for r in records}
        ax2.bar([i + offset for i in range(len(methods))], [tau[m] for m in methods], 0.4, label=name)
    ax2.set_xticks(range(len(methods)), methods, rotation=20)
    ax2.set_ylim(4.5, 7.0)
    ax2.axhline(7.0, color="gray", linestyle=":")
    ax2.set_ylabel("τ (tokens per iteration, max 7)")
    ax2.set_title("Selection policies, B=8, 7.9K-token prompts")
    ax2.legend()
    plot_profiles(ax3)
    fig.tight_layout()
    out = RESULTS / "e2e-summary.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    print(f"wrote {plot_serving('serve3-b64-refill8')}")
    print(f"wrote {plot_prefill()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
