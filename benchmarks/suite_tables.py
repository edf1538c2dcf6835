"""The benchmark suite's records turned into what the report shows: rows of a kind, speedups, the issues' targets
(met, missed, or not yet measured), the task families compared and their geometric mean, throughput projected at
SmolLM2's τ, and Markdown tables. Pure functions of the records, so the results in README.md and docs/ are
regenerated from the JSON and never copied by hand. The tables and targets from before task families read
summarise's records (a record naming no family is summarise's); the families' own read each family's."""

from __future__ import annotations

import dataclasses
import math

from benchmarks.suite_presets import BASELINES, PRESETS
from benchmarks.suite_records import value_of
from benchmarks.task_families import DEFAULT_FAMILY, FAMILIES, REGISTRY

EIGHT_K = 7936  # the suite's 8K prompts: 8,192 tokens of context less 256 new tokens


def _is(r: dict, **fields) -> bool:
    return all(r.get(k) == v for k, v in fields.items())


def family_of(r: dict) -> str:
    return value_of(r, "family")


def heldout_rows(records, *, temperature: float | None = None, tuned: bool | None = None,
                 default: bool | None = None, stage: str = "heldout",
                 family: str | None = DEFAULT_FAMILY) -> list[dict]:
    """A stage's rows (held-out by default) of one family (None: every family's), filtered."""
    rows = [r for r in records if r.get("stage") == stage and family in (None, family_of(r))]
    if temperature is not None:
        rows = [r for r in rows if r.get("temperature") == temperature]
    if tuned is not None:
        rows = [r for r in rows if bool(r.get("tuned")) == tuned or r["method"] == "ar"]
    if default is not None:
        rows = [r for r in rows if bool(r.get("default")) == default or r["method"] == "ar"]
    return rows


def scale_card(records) -> str | None:
    """The card the scale tables are of: that of the latest plain scale record. An iteration's cost in plain steps
    compares times of one card, so records of another card stay out of the tables."""
    plain = [r for r in records if r.get("stage") == "scale" and r.get("fits") and r.get("method") == "ar"]
    return max(plain, key=lambda r: r["date"]).get("device") if plain else None


def scale_rows(records) -> list[dict]:
    """The scale stage's measured records of scale_card's card, one per (model, context, batch, method): the latest,
    since several presets' logs measure the same case and a later record has the later code and bandwidth probe."""
    card, latest = scale_card(records), {}
    for r in records:
        if r.get("stage") == "scale" and r.get("fits") and r.get("device") == card:
            case = (r["model"], r["context"], r["batch"], r["method"])
            if case not in latest or r["date"] > latest[case]["date"]:
                latest[case] = r
    return sorted(latest.values(), key=lambda r: (r["model"], r["context"], r["batch"], r["method"] != "ar",
                                                  r["method"]))


def plain_rate(records, r: dict) -> float | None:
    """Plain decoding's rate measured with record r: same stage (a quantized draft's, the held-out one), family,
    split, batch, length, temperature, requests."""
    stage = "heldout" if r.get("stage") == "quantized" else r.get("stage")
    for other in records:
        if (other.get("method") == "ar" and other.get("stage") == stage and family_of(other) == family_of(r)
                and all(other.get(k) == r.get(k) for k in ("split", "batch", "prompt_tokens", "temperature",
                                                            "requests"))):
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


def scale_refusals(records, card: str | None) -> list[dict]:
    """The scale records of `card` that did not fit it (refused by the memory plan, or out of memory past it)."""
    return [r for r in records if r.get("stage") == "scale" and r.get("fits") is False and r.get("device") == card]


def other_card_rows(records) -> list[dict]:
    """The latest measured scale record of each (card, model, context, batch, method) whose card is not
    scale_card's and that says where the plain step it was put over comes from (`plain_source`: always its own card;
    records without it may have taken another card's)."""
    card, latest = scale_card(records), {}
    for r in records:
        if (r.get("stage") == "scale" and r.get("fits") and r.get("device") != card
                and r.get("plain_source") and r.get("plain_ms_per_step") is not None):
            case = (r.get("device"), r["model"], r["context"], r["batch"], r["method"])
            if case not in latest or r["date"] > latest[case]["date"]:
                latest[case] = r
    return [latest[k] for k in sorted(latest, key=lambda k: (str(k[0]), k[1], k[2], k[3], k[4]))]


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


def adaptive_comparisons(records, family: str = DEFAULT_FAMILY) -> list[dict]:
    """Per adaptive-γ record of the family (the suite's adaptive stage), and per held-out row its log's preset
    times adaptive γ at but has no record of yet (auto None), the rates it is judged against, measured on the same
    held-out prompts, batch and length: plain decoding's and the fastest fixed γ's (Vegas at its tuned and at the
    default cell). Longest prompts and largest batches first."""
    autos = {(r["prompt_tokens"], r["batch"]): r for r in heldout_rows(records, stage="adaptive", family=family)}
    for r in heldout_rows(records, temperature=0.0, family=family):
        preset = PRESETS.get(r.get("log", "").removeprefix("suite-"))
        if (r["method"] == "ar" and preset is not None and r["batch"] in preset.adaptive_batches
                and family in preset.families):
            autos.setdefault((r["prompt_tokens"], r["batch"]), None)
    out = []
    for (length, batch), auto in sorted(autos.items(), key=lambda item: (-item[0][0], -item[0][1])):
        same = [o for o in heldout_rows(records, temperature=auto["temperature"] if auto else 0.0, family=family)
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


# ---- task families (issue 48) ----------------------------------------------------------------------------


def headline_length(family: str) -> int:
    """The prompt length a family is compared at across families: 8K, or its own (long generation's short one)."""
    return REGISTRY[family].prompt_tokens or EIGHT_K


def family_cells(records, family: str) -> list[dict]:
    """Per (prompt length, batch) of the family's held-out greedy rows, longest and largest first: plain decoding,
    Vegas and each baseline at its tuned cell, the fastest baseline, and Vegas's rate over it and over plain
    decoding (None where a side is missing)."""
    rows = heldout_rows(records, temperature=0.0, tuned=True, family=family)
    out = []
    for length, batch in sorted({(r["prompt_tokens"], r["batch"]) for r in rows}, reverse=True):
        cell = {r["method"]: r for r in rows if (r["prompt_tokens"], r["batch"]) == (length, batch)}
        baselines = {m: cell[m] for m in BASELINES if m in cell}
        best = max(baselines.values(), key=lambda r: r["decode_tokens_per_s"]) if baselines else None
        vegas, plain = cell.get("vegas"), cell.get("ar")
        out.append({"family": family, "length": length, "batch": batch, "plain": plain, "vegas": vegas,
                    "baselines": baselines, "best": best,
                    "over_best": vegas["decode_tokens_per_s"] / best["decode_tokens_per_s"] if vegas and best else None,
                    "over_plain": vegas["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if vegas and plain
                    else None})
    return out


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def across_families(records) -> list[dict]:
    """Per batch measured, largest first: each family's cell at its headline length (family_cells) and the
    geometric means across the families measured there of Vegas over the fastest baseline and over plain."""
    cells = {(c["family"], c["batch"]): c for family in FAMILIES for c in family_cells(records, family)
             if c["length"] == headline_length(family)}
    out = []
    for batch in sorted({b for _, b in cells}, reverse=True):
        row = {family: cells[family, batch] for family in FAMILIES if (family, batch) in cells}
        means = {}
        for key in ("over_best", "over_plain"):
            values = [c[key] for c in row.values() if c[key] is not None]
            means[key] = geometric_mean(values) if values else None
        out.append({"batch": batch, "families": row, **means})
    return out


def _family_label(c: dict) -> str:
    return f"{c['family']} B{c['batch']}"


def target_families_over_baselines(records, families=("quote", "retrieval"), need: float = 1.3) -> Target:
    """Vegas >= 1.3x the fastest tuned baseline on quote/edit and retrieval, held-out, greedy, batch 32-64, 8K."""
    checks, parts = [], []
    for family in families:
        for c in family_cells(records, family):
            if c["length"] == EIGHT_K and c["batch"] in (32, 64) and c["over_best"] is not None:
                checks.append(c["over_best"] >= need)
                parts.append(f"{_family_label(c)}: {_digits(c['over_best'], need, 2)}x {c['best']['method']}")
    return Target(f"Vegas >= {need:g}x the best tuned baseline on {' and '.join(families)}, batch 32-64, 8K",
                  _status(checks), _worst_first(checks, parts))


def target_geometric_mean(records, need: float = 1.15) -> Target:
    """Vegas over the fastest tuned baseline, geometric mean across the families (each at its headline length),
    >= 1.15x at batch 32 and 64; met so far while families are missing there."""
    checks, parts, incomplete = [], [], False
    for row in across_families(records):
        if row["batch"] in (32, 64) and row["over_best"] is not None:
            checks.append(row["over_best"] >= need)
            measured = [f for f, c in row["families"].items() if c["over_best"] is not None]
            missing = [f for f in FAMILIES if f not in measured]
            incomplete |= bool(missing)
            parts.append(f"B{row['batch']}: {_digits(row['over_best'], need, 2)}x over {len(measured)} families"
                         + (f" (not yet measured: {', '.join(missing)})" if missing else ""))
    status = "met so far" if incomplete and checks and all(checks) else _status(checks)
    return Target(f"Vegas >= {need:g}x the best tuned baseline, geometric mean across task families, batch 32-64",
                  status, "; ".join(parts) or "-")


def target_no_family_below(records, floor: float = 0.97) -> Target:
    """No family's Vegas below 0.97x its fastest tuned baseline at any batch of its headline length (a miss needs
    a stated measured reason beside the table)."""
    checks, parts = [], []
    for family in FAMILIES:
        for c in family_cells(records, family):
            if c["length"] == headline_length(family) and c["over_best"] is not None:
                checks.append(c["over_best"] >= floor)
                parts.append(f"{_family_label(c)}: {_digits(c['over_best'], floor, 2)}x {c['best']['method']}")
    return Target(f"no task family below {floor:g}x the best tuned baseline (or a stated measured reason)",
                  _status(checks), _worst_first(checks, parts))


def target_two_families_over_plain(records, need: float = 2.0, families_needed: int = 2) -> Target:
    """Vegas >= 2x plain decoding at batch 64 x 8K on at least two families."""
    cells = [c for family in FAMILIES for c in family_cells(records, family)
             if c["length"] == EIGHT_K and c["batch"] == 64 and c["over_plain"] is not None]
    reaching = [c for c in cells if c["over_plain"] >= need]
    status = ("met" if len(reaching) >= families_needed else "not yet measured" if not cells
              else "missed" if len(cells) == len([f for f in FAMILIES if headline_length(f) == EIGHT_K])
              else "missed so far")
    parts = [f"{c['family']} {_digits(c['over_plain'], need, 2)}x" for c in
             sorted(cells, key=lambda c: -c["over_plain"])]
    return Target(f"Vegas >= {need:g}x plain decoding at batch 64 x 8K on at least {families_needed} families", status,
                  "; ".join(parts) or "-")


def targets(records, legacy=()) -> list[Target]:
    return [target_vegas_over_baselines(records), target_tau(records, legacy), target_roofline(records, 8, 0.85),
            target_roofline(records, 1, 0.75), target_iteration(records), *targets_adaptive(records),
            target_families_over_baselines(records), target_geometric_mean(records), target_no_family_below(records),
            target_two_families_over_plain(records)]


# ---- projection at SmolLM2's τ -----------------------------------------------------------------------------


def tau_source(tau_records, method: str, batch: int) -> dict | None:
    """SmolLM2's greedy τ of `method` at the default cell (γ 6, 7 %: the scale runs' configuration), held-out (or,
    before the suite, a legacy record), the longest prompts measured, the batch closest to `batch`."""
    rows = [r for r in tau_records if r.get("method") == method and r.get("temperature") == 0.0
            and r.get("gamma") == 6 and r.get("sparse_ratio") == 0.07 and r.get("tau")
            and (r.get("stage") == "legacy" or (r.get("stage") == "heldout" and r.get("default")
                                                and family_of(r) == DEFAULT_FAMILY))]
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
