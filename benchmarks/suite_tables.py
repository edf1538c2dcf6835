"""The benchmark suite's records turned into what the report shows: rows of a kind, speedups, the issue's targets
(met, missed, or not yet measured), throughput projected at SmolLM2's τ, and Markdown tables. Pure functions of
the records, so the results in docs/benchmarks.md are regenerated from the JSON and never copied by hand."""

from __future__ import annotations

import dataclasses

from benchmarks.suite_presets import BASELINES, PRESETS
EIGHT_K = 7936  # the suite's 8K prompts: 8,192 tokens of context less 256 new tokens


def _is(r: dict, **fields) -> bool:
    return all(r.get(k) == v for k, v in fields.items())


def heldout_rows(records, *, temperature: float | None = None, tuned: bool | None = None,
                 default: bool | None = None, stage: str = "heldout") -> list[dict]:
    rows = [r for r in records if r.get("stage") == stage]
    if temperature is not None:
        rows = [r for r in rows if r.get("temperature") == temperature]
    if tuned is not None:
        rows = [r for r in rows if bool(r.get("tuned")) == tuned or r["method"] == "ar"]
    if default is not None:
        rows = [r for r in rows if bool(r.get("default")) == default or r["method"] == "ar"]
    return rows


def scale_rows(records) -> list[dict]:
    """The scale stage's measured records, one per (model, context, batch, method): the latest, since several
    presets' logs measure the same case and a later record has the later code and bandwidth probe."""
    latest = {}
    for r in records:
        if r.get("stage") == "scale" and r.get("fits"):
            case = (r["model"], r["context"], r["batch"], r["method"])
            if case not in latest or r["date"] > latest[case]["date"]:
                latest[case] = r
    return sorted(latest.values(), key=lambda r: (r["model"], r["context"], r["batch"], r["method"] != "ar",
                                                  r["method"]))


def plain_rate(records, r: dict) -> float | None:
    """Plain decoding's rate measured with record r: same stage, split, batch, length, temperature, requests."""
    for other in records:
        if other.get("method") == "ar" and all(other.get(k) == r.get(k) for k in
                                           ("stage", "split", "batch", "prompt_tokens", "temperature", "requests")):
            return other["decode_tokens_per_s"]
    return None


def speedup(records, r: dict) -> float | None:
    plain = plain_rate(records, r)
    return r["decode_tokens_per_s"] / plain if plain else None


# ---- targets -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    name: str
    status: str  # "met", "missed", "not yet measured"
    result: str


def _status(values: list[bool]) -> str:
    return "not yet measured" if not values else "met" if all(values) else "missed"


def _digits(value: float, bound: float, digits: int) -> str:
    """`value` with at least `digits` decimals and as many more as keep it on its own side of `bound`, so that a
    missed target never reads as the bound itself (1.1497 against 1.15 shows 1.1497, not 1.15)."""
    def side(x: float) -> int:
        return (x > bound) - (x < bound)

    while digits < 6 and side(round(value, digits)) != side(value):
        digits += 1
    return f"{value:.{digits}f}"


def target_vegas_over_baselines(records, need: float = 1.15) -> Target:
    """Vegas >= 1.15x the fastest baseline, each at its tuned cell, held-out, greedy, batch 32-64, 8K prompts."""
    rows = [r for r in heldout_rows(records, temperature=0.0, tuned=True)
            if r["prompt_tokens"] == EIGHT_K and r["batch"] in (32, 64)]
    checks, parts = [], []
    for batch in sorted({r["batch"] for r in rows}, reverse=True):
        vegas = [r for r in rows if r["batch"] == batch and r["method"] == "vegas"]
        baselines = [r for r in rows if r["batch"] == batch and r["method"] in BASELINES]
        if not vegas or not baselines:
            continue
        best = max(baselines, key=lambda r: r["decode_tokens_per_s"])
        ratio = vegas[0]["decode_tokens_per_s"] / best["decode_tokens_per_s"]
        checks.append(ratio >= need)
        parts.append(f"B{batch}: {_digits(ratio, need, 2)}x {best['method']}")
    return Target(f"Vegas >= {need}x the best baseline, each tuned, held-out, batch 32-64, 8K", _status(checks),
                  "; ".join(parts) or "-")


def _worst_first(checks: list[bool], parts: list[str]) -> str:
    """The cells a target misses first, four at most shown, so a shortened list still shows why it is missed."""
    parts = [part for _, part in sorted(zip(checks, parts), key=lambda pair: pair[0])]
    shown = parts if len(parts) <= 4 else parts[:4] + [f"... {len(parts) - 4} more"]
    return "; ".join(shown) or "-"


def target_tau(records, legacy=()) -> Target:
    """τ of Vegas >= every baseline's at equal γ and budget (the common default cell), greedy and sampled."""
    def check(rows, label):
        checks, worst = [], []
        groups = {(r["batch"], r["prompt_tokens"], r["temperature"]) for r in rows}
        for batch, length, temperature in sorted(groups):
            group = [r for r in rows if (r["batch"], r["prompt_tokens"], r["temperature"]) == (batch, length, temperature)]
            vegas = [r for r in group if r["method"] == "vegas"]
            baselines = [r for r in group if r["method"] in BASELINES]
            if not vegas or not baselines:
                continue
            best = max(baselines, key=lambda r: r["tau"])
            checks.append(vegas[0]["tau"] >= best["tau"])
            worst.append(f"B{batch} {length} T{temperature:g}: {vegas[0]['tau']:.2f} vs {best['method']} "
                         f"{best['tau']:.2f}" + ("" if checks[-1] else " (below)"))
        return checks, worst

    rows = [r for r in heldout_rows(records, default=True) if r["method"] != "ar"]
    checks, parts = check(rows, "suite")
    source = ""
    if not checks and legacy:
        checks, parts = check([r for r in legacy if r.get("gamma") == 6 and r.get("sparse_ratio") == 0.07
                               and r["method"] != "ar"], "legacy")
        source = " (before the suite: one run each, `e2e-2026-11-30-policies-*-logit.json`)"
    return Target("τ of Vegas >= every baseline's at equal γ and budget", _status(checks),
                  _worst_first(checks, parts) + source if parts else "-")


def _scale_value(records, model: str, context: int, batch: int, method: str, field: str):
    for r in scale_rows(records):
        if (r["model"], r["context"], r["batch"], r["method"]) == (model, context, batch, method):
            return r.get(field)
    return None


def target_roofline(records, batch: int, need: float) -> Target:
    checks, parts = [], []
    for model in ("llama-3.1-8b", "qwen3-8b"):
        fraction = _scale_value(records, model, 32768, batch, "ar", "roofline_fraction")
        if fraction is not None:
            checks.append(fraction >= need)
            parts.append(f"{model} {_digits(100 * fraction, 100 * need, 0)} %")
    return Target(f"8B shapes: plain decoding >= {100 * need:.0f} % of the roofline at batch {batch} x 32K",
                  _status(checks), "; ".join(parts) or "-")


def target_iteration(records, most: float = 3.0) -> Target:
    checks, parts = [], []
    for model in ("llama-3.1-8b", "qwen3-8b"):
        steps = _scale_value(records, model, 32768, 8, "vegas", "plain_steps_per_iteration")
        if steps is not None:
            checks.append(steps <= most)
            parts.append(f"{model} {_digits(steps, most, 2)} plain steps")
    return Target(f"8B shapes: a Vegas iteration <= {most:g} plain steps at batch 8 x 32K", _status(checks),
                  "; ".join(parts) or "-")


def adaptive_comparisons(records) -> list[dict]:
    """Per adaptive-γ record (the suite's adaptive stage), and per held-out row its log's preset times adaptive γ
    at but has no record of yet (auto None), the rates it is judged against, measured on the same held-out prompts,
    batch and length: plain decoding's and the fastest fixed γ's (Vegas at its tuned and at the default cell).
    Longest prompts and largest batches first."""
    autos = {(r["prompt_tokens"], r["batch"]): r for r in records if r.get("stage") == "adaptive"}
    for r in heldout_rows(records, temperature=0.0):
        preset = PRESETS.get(r.get("log", "").removeprefix("suite-"))
        if r["method"] == "ar" and preset is not None and r["batch"] in preset.adaptive_batches:
            autos.setdefault((r["prompt_tokens"], r["batch"]), None)
    out = []
    for (length, batch), auto in sorted(autos.items(), key=lambda item: (-item[0][0], -item[0][1])):
        same = [o for o in heldout_rows(records, temperature=auto["temperature"] if auto else 0.0)
                if (o["batch"], o["prompt_tokens"]) == (batch, length)]
        fixed = [o for o in same if o["method"] == "vegas"]
        plain = next((o for o in same if o["method"] == "ar"), None)
        out.append({"cell": (length, batch), "auto": auto, "plain": plain,
                    "best_fixed": max(fixed, key=lambda o: o["decode_tokens_per_s"]) if fixed else None})
    return out


def targets_adaptive(records, floor: float = 0.97, within: float = 0.05) -> list[Target]:
    """Issue 19's: `--gamma auto` never below 0.97x plain decoding at any batch and length measured, and within
    5 % of the best fixed γ."""
    over_plain, over_best = ([], []), ([], [])
    comparisons = adaptive_comparisons(records)
    for c in (c for c in comparisons if c["auto"]):
        auto, label = c["auto"], f"B{c['auto']['batch']} {c['auto']['prompt_tokens']}"
        if c["plain"]:
            ratio = auto["decode_tokens_per_s"] / c["plain"]["decode_tokens_per_s"]
            over_plain[0].append(ratio >= floor)
            over_plain[1].append(f"{label}: {_digits(ratio, floor, 2)}x")
        if c["best_fixed"]:
            ratio = auto["decode_tokens_per_s"] / c["best_fixed"]["decode_tokens_per_s"]
            over_best[0].append(ratio >= 1 - within)
            over_best[1].append(f"{label}: {_digits(ratio, 1 - within, 2)}x γ {c['best_fixed']['gamma']}")
    pending = [c["cell"] for c in comparisons if not c["auto"]]
    # A target met so far is not met while cells it names are still to be measured.
    status = lambda checks: "met so far" if pending and checks and all(checks) else _status(checks)  # noqa: E731
    left = f" (not yet measured: {', '.join(f'{n} x {b}' for n, b in pending)})" if pending else ""
    return [Target(f"`--gamma auto` >= {floor:g}x plain decoding at every batch and length (issue 19)",
                   status(over_plain[0]), _worst_first(*over_plain) + left),
            Target(f"`--gamma auto` within {100 * within:g} % of the best fixed γ (issue 19)",
                   status(over_best[0]), _worst_first(*over_best) + left)]


def targets(records, legacy=()) -> list[Target]:
    return [target_vegas_over_baselines(records), target_tau(records, legacy), target_roofline(records, 8, 0.85),
            target_roofline(records, 1, 0.75), target_iteration(records), *targets_adaptive(records)]


# ---- projection at SmolLM2's τ -----------------------------------------------------------------------------


def tau_source(tau_records, method: str, batch: int) -> dict | None:
    """SmolLM2's greedy τ of `method` at the default cell (γ 6, 7 %: the scale runs' configuration), held-out (or,
    before the suite, a legacy record), the longest prompts measured, the batch closest to `batch`."""
    rows = [r for r in tau_records if r.get("method") == method and r.get("temperature") == 0.0
            and r.get("gamma") == 6 and r.get("sparse_ratio") == 0.07 and r.get("tau")
            and (r.get("stage") == "legacy" or (r.get("stage") == "heldout" and r.get("default")))]
    if not rows:
        return None
    longest = max(r["prompt_tokens"] for r in rows)
    return min((r for r in rows if r["prompt_tokens"] == longest), key=lambda r: abs(r["batch"] - batch))


def projections(records, tau_records=None) -> list[dict]:
    """Per 8B-shaped (model, context, batch): plain tokens/s as measured, and Vegas's and Stream's at the τ
    SmolLM2 reached (a projection: random weights accept nothing meaningful)."""
    tau_records = records if tau_records is None else tau_records
    out = []
    for r in scale_rows(records):
        if r["method"] != "ar":
            continue
        p = {"model": r["model"], "context": r["context"], "batch": r["batch"],
             "plain_tokens_per_s": 1e3 * r["batch"] / r["ms_per_iteration"]}
        for method in ("vegas", "streaming"):
            ms = _scale_value(records, r["model"], r["context"], r["batch"], method, "ms_per_iteration")
            source = tau_source(tau_records, method, r["batch"])
            if ms and source:
                p[f"{method}_tokens_per_s"] = 1e3 * r["batch"] * source["tau"] / ms
                p[f"{method}_tau"] = source["tau"]
                p[f"{method}_tau_from"] = f"B{source['batch']} x {source['prompt_tokens']}"
        out.append(p)
    return out


# ---- Markdown ----------------------------------------------------------------------------------------------


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def rate_cell(records, r: dict | None, with_spread: bool = True) -> str:
    if r is None:
        return "-"
    text = fmt_rate(r["decode_tokens_per_s"])
    if with_spread and r.get("decode_tokens_per_s_min") is not None:
        text += f" ({fmt_rate(r['decode_tokens_per_s_min'])}-{fmt_rate(r['decode_tokens_per_s_max'])})"
    s = speedup(records, r) if r["method"] != "ar" else None
    return text + (f", {s:.2f}x" if s else "")
