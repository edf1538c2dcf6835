"""Plots of the committed end-to-end results: decode throughput (plain vs Vegas) and τ per selection policy.

    pip install -e '.[bench]' && python benchmarks/plot_results.py   # writes benchmarks/results/e2e-summary.png
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


def main() -> int:
    throughput = load("4k") + load("8k")
    policies = {"greedy": load("policies-greedy-logit"), "T=0.7": load("policies-t07-logit")}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))

    configs = sorted({(r["prompt_tokens"], r["batch"]) for r in throughput})
    labels = [f"{p / 1000:.1f}K x B{b}" for p, b in configs]
    for offset, method in [(-0.2, "ar"), (0.2, "vegas")]:
        rate = {(r["prompt_tokens"], r["batch"]): r["decode_tokens_per_s"] for r in throughput if r["method"] == method}
        bars = ax1.bar([i + offset for i in range(len(configs))], [rate[c] for c in configs], 0.4, label=method)
        if method == "vegas":
            speedups = {(r["prompt_tokens"], r["batch"]): r["speedup_vs_ar"] for r in throughput if r["method"] == method}
            for bar, c in zip(bars, configs):
                ax1.annotate(f"{speedups[c]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                             ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(configs)), labels)
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
    fig.tight_layout()
    out = RESULTS / "e2e-summary.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
