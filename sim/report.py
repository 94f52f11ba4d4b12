"""Turn replay results into the simulator's report: rows, a terminal table, JSON, a plot.

    [ReplayResult] + trace meta + HardwareProfile
    -> rows: hit rate, misses and MB copied per token, share of the LRU-to-Belady gap
       recovered, modeled us/token and tokens/s without and with the shared-expert overlap
       (both from sim.costmodel.estimate_ranks, which is estimate_decode on one GPU: tokens/s = batch
       * 1e6 / us per decode step); a replay over N GPUs (sim.ranks) gets a row of its own, its slots
       those of each GPU, its misses and MB summed over the GPUs
    -> format_table (terminal), rows as JSON, plot_hit_rate (PNG), format_per_layer; choices: per
       slot count the deployable policy with the most modeled tokens/s, against lru's and beside the
       limit (belady) and the other oracles (format_choices, printed under the table)
    [ReplayResult] + [sim.budget.FormatRun] -> build_format_rows: one row per (budget, format,
       policy, slots), priced at the format's bytes -> format_budget_table, the same JSON plus
       format, expert_bytes, moe_cache_gb, slots_gib, all_experts_fit, bytes_copied_per_token
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from expertcache.formats import GIB
from expertcache.words import counted
from sim.budget import FormatRun, trace_shape
from sim.costmodel import H200, DecodeEstimate, HardwareProfile, ModelShape, estimate_ranks
from sim.replay import ReplayResult
from sim.trace import Trace

LIMIT = "belady"  # the one oracle no policy can beat
ORACLE_KNOWS = {"belady": "knows the whole future", "next-token": "knows the next token"}


@dataclass(frozen=True)
class Row:
    """One (policy, slots) line of the report; `gap_recovered` is None without references.
    Times are per decode step; tokens_per_s[_overlap] count every batch row (batch * 1e6 / us)."""

    result: ReplayResult
    slots_frac: float
    gap_recovered: float | None
    us_per_token: float | None
    tokens_per_s: float | None
    us_per_token_overlap: float | None
    tokens_per_s_overlap: float | None
    mb_copied_per_token: float | None
    bytes_copied_per_token: float | None = None
    run: FormatRun | None = None  # the (budget, format) of a format row; None: the plain report

    @property
    def slots_gib(self) -> float | None:
        """GiB the slots take in the row's format (None without a format or a known size)."""
        if self.run is None or self.run.expert_bytes is None:
            return None
        return self.result.slots * self.run.expert_bytes / GIB

    def to_dict(self) -> dict:
        d = self.result.to_dict()
        d.update(slots_frac=self.slots_frac, gap_recovered=self.gap_recovered,
                 us_per_token=self.us_per_token, tokens_per_s=self.tokens_per_s,
                 us_per_token_overlap=self.us_per_token_overlap,
                 tokens_per_s_overlap=self.tokens_per_s_overlap,
                 mb_copied_per_token=self.mb_copied_per_token)
        if self.run is not None:
            d.update(format=self.run.fmt, expert_bytes=self.run.expert_bytes,
                     moe_cache_gb=self.run.budget_gib, slots_gib=self.slots_gib,
                     all_experts_fit=self.run.all_fit,
                     bytes_copied_per_token=self.bytes_copied_per_token)
        return d


def model_shape(trace: Trace) -> ModelShape | None:
    """The cost model's shape for a trace, or None when its meta gives too little
    (sim.budget.trace_shape: the meta's expert shape when it has one, else expert_bytes)."""
    return trace_shape(trace)


def estimate(result: ReplayResult, shape: ModelShape, profile: HardwareProfile = H200, *, batch: int = 1,
             overlap: bool = False) -> DecodeEstimate:
    """The cost model's estimate of one replay, over its ranks (sim.costmodel.estimate_ranks: one rank is
    estimate_decode)."""
    routed = None if result.layer_routed is None else int(result.layer_routed.sum())
    return estimate_ranks(result.hist, result.tokens, shape, profile, ranks=result.ranks, routed=routed,
                          misses=result.misses, batch=batch, overlap=overlap, policy=result.policy)


def build_rows(trace: Trace, results: list[ReplayResult],
               profile: HardwareProfile = H200, shape: ModelShape | None = None) -> list[Row]:
    """One Row per result. The gap share is (lru - p) / (lru - belady) misses at the same
    slot count and ranks, when both references were replayed (1.0 when lru already equals belady).
    shape prices the misses (default: model_shape(trace); no prices when neither gives one)."""
    by = {(r.policy, r.slots, r.ranks): r for r in results}
    shape = shape or model_shape(trace)
    total = trace.num_layers * trace.num_experts
    rows = []
    for r in results:
        lru, opt = by.get(("lru", r.slots, r.ranks)), by.get(("belady", r.slots, r.ranks))
        gap = None
        if lru is not None and opt is not None:
            width = lru.misses - opt.misses
            gap = 1.0 if width == 0 else (lru.misses - r.misses) / width
        us = tps = us_ov = tps_ov = mb = per_tok = None
        if shape is not None:
            est = estimate(r, shape, profile, batch=trace.batch)
            ov = estimate(r, shape, profile, batch=trace.batch, overlap=True)
            us, tps = est.us_per_token, est.tokens_per_s
            us_ov, tps_ov = ov.us_per_token, ov.tokens_per_s
            per_tok = est.bytes_copied_per_token
            mb = per_tok / 1e6
        rows.append(Row(r, r.slots / total, gap, us, tps, us_ov, tps_ov, mb, per_tok))
    return rows


def build_format_rows(trace: Trace, results: list[ReplayResult], runs: list[FormatRun],
                      profile: HardwareProfile = H200, policies: list[str] | None = None) -> list[Row]:
    """Rows of every run in order, each at its slot counts and priced by its shape; the gap
    column as in build_rows. policies: the ones to keep (default all), in the results' order."""
    rows = []
    for run in runs:
        mine = [r for r in results if r.slots in run.slots]
        rows += [replace(row, run=run) for row in build_rows(trace, mine, profile, run.shape)
                 if policies is None or row.result.policy in policies]
    return rows


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _ranks_column(rows: list[Row]) -> tuple[str, dict[int, str]]:
    """The ranks column's head and its cell by rank count, both '' when every row is one GPU's: a table of
    one GPU has no ranks column."""
    if all(row.result.ranks == 1 for row in rows):
        return "", {}
    return f" {'ranks':>5}", {row.result.ranks: f" {row.result.ranks:>5}" for row in rows}


def format_table(rows: list[Row], title: str = "") -> str:
    """A fixed-width table, one line per row, grouped by slot count (slots a GPU), then ranks."""
    w = max([8] + [len(row.result.policy) for row in rows])  # the policy column: its longest name
    ranks_head, ranks = _ranks_column(rows)
    head = (f"{'policy':<{w}} {'slots':>7}{ranks_head} {'%exp':>5} {'hit rate':>8} {'miss/tok':>9} "
            f"{'MB/tok':>8} {'gap rec.':>8} {'us/tok':>9} {'tok/s':>8} {'tok/s ov':>8}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for row in sorted(rows, key=lambda x: (x.result.slots, x.result.ranks, x.result.policy)):
        r = row.result
        lines.append(
            f"{r.policy:<{w}} {r.slots:>7}{ranks.get(r.ranks, '')} {100 * row.slots_frac:>5.1f} {r.hit_rate:>8.4f} "
            f"{r.misses_per_token:>9.2f} {_fmt(row.mb_copied_per_token, '8.1f'):>8} "
            f"{_fmt(row.gap_recovered, '8.3f'):>8} {_fmt(row.us_per_token, '9.1f'):>9} "
            f"{_fmt(row.tokens_per_s, '8.1f'):>8} {_fmt(row.tokens_per_s_overlap, '8.1f'):>8}")
    return "\n".join(lines)


def format_budget_table(rows: list[Row], title: str = "") -> str:
    """The table of format rows: per run (budget, then format, in the order given) one line per
    (slots, policy), with the format, its bytes per expert and the GiB its slots take. Slots of a
    budget that holds every expert carry a '*', explained under the table."""
    w = max([8] + [len(row.result.policy) for row in rows])  # the policy column: its longest name
    ranks_head, ranks = _ranks_column(rows)
    head = (f"{'budget':>6} {'format':<6} {'B/expert':>11} {'slots':>7}{ranks_head} {'GiB':>6} {'%exp':>5} "
            f"{'policy':<{w}} {'hit rate':>8} {'miss/tok':>9} {'MB/tok':>8} {'gap rec.':>8} "
            f"{'us/tok':>9} {'tok/s':>8} {'tok/s ov':>8}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    order = list(dict.fromkeys(row.run for row in rows))
    fit: dict[float | None, list[str]] = {}
    for row in sorted(rows, key=lambda x: (order.index(x.run), x.result.slots, x.result.ranks, x.result.policy)):
        r, run = row.result, row.run
        assert run is not None, "format_budget_table takes the rows of build_format_rows"
        budget = "-" if run.budget_gib is None else f"{run.budget_gib:g}"
        slots = f"{r.slots}*" if run.all_fit else f"{r.slots} "
        if run.all_fit and run.fmt not in fit.setdefault(run.budget_gib, []):
            fit[run.budget_gib].append(run.fmt)
        lines.append(
            f"{budget:>6} {run.fmt:<6} {_fmt(run.expert_bytes, '11,d'):>11} {slots:>8}{ranks.get(r.ranks, '')}"
            f"{_fmt(row.slots_gib, '6.2f'):>6} {100 * row.slots_frac:>5.1f} {r.policy:<{w}} "
            f"{r.hit_rate:>8.4f} {r.misses_per_token:>9.2f} {_fmt(row.mb_copied_per_token, '8.1f'):>8} "
            f"{_fmt(row.gap_recovered, '8.3f'):>8} {_fmt(row.us_per_token, '9.1f'):>9} "
            f"{_fmt(row.tokens_per_s, '8.1f'):>8} {_fmt(row.tokens_per_s_overlap, '8.1f'):>8}")
    for gib, fmts in fit.items():
        lines.append(f"* all experts fit: {gib:g} GiB holds every one of the trace's L x E experts "
                     f"in {', '.join(fmts)}: slots = L x E, and GiB is what they take")
    return "\n".join(lines)


def choices(rows: list[Row], oracles: tuple[str, ...]) -> list[dict]:
    """Per slot count (and format run, and rank count), the deployable policy a user would pick: the most
    modeled tokens/s (no overlap), or the fewest misses where the trace has no price (ties: the name). vs_lru
    is its figure over lru's at the same slots (tok/s, or misses: below 1 is better), None without lru (or
    when lru has no misses); oracles: each oracle's figure, for comparison. Oracles are never picked.
    vs_one_gpu (ranks > 1, priced): its tok/s over the pick of one GPU at the same slots a GPU, None where
    one GPU did not run."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.run, row.result.slots, row.result.ranks), []).append(row)
    out = []
    for (run, slots, ranks), group in groups.items():
        deployable = [r for r in group if r.result.policy not in oracles]
        if not deployable:
            continue
        priced = all(r.tokens_per_s is not None for r in group)

        def key(r: Row, priced: bool = priced) -> tuple:
            return (-r.tokens_per_s if priced else r.result.misses, r.result.policy)
        best = min(deployable, key=key)
        lru = next((r for r in group if r.result.policy == "lru"), None)
        ratio = None
        if lru is not None:
            ratio = (best.tokens_per_s / lru.tokens_per_s if priced
                     else (best.result.misses / lru.result.misses if lru.result.misses else None))
        out.append({"run": run, "slots": slots, "ranks": ranks, "slots_frac": best.slots_frac,
                    "policy": best.result.policy, "tokens_per_s": best.tokens_per_s, "misses": best.result.misses,
                    "vs_lru": ratio, "oracles": {r.result.policy: (r.tokens_per_s if priced else r.result.misses)
                                                 for r in group if r.result.policy in oracles}})
    one = {(c["run"], c["slots"]): c["tokens_per_s"] for c in out if c["ranks"] == 1}
    for c in out:
        base = one.get((c["run"], c["slots"]))
        c["vs_one_gpu"] = None if c["ranks"] == 1 or not base or c["tokens_per_s"] is None else c["tokens_per_s"] / base
    return out


def _choice_head(picks: list[dict], priced: bool) -> str:
    """The line above the choices: what ranks them, which oracle is the limit and which only compare."""
    what = ("modeled tok/s (no overlap)" if priced
            else "fewest misses (the trace has no expert size to price them)")
    ran = sorted({p for c in picks for p in c["oracles"]})
    notes = []
    if LIMIT in ran:
        notes.append(f"{LIMIT} ({ORACLE_KNOWS[LIMIT]}) is the limit")
    others = [f"{p} ({ORACLE_KNOWS[p]})" if p in ORACLE_KNOWS else p for p in ran if p != LIMIT]
    if others:
        notes.append(f"{', '.join(others)} {'an oracle' if len(others) == 1 else 'oracles'} to compare with")
    return f"choice by {what}, never an oracle" + ("; " + ", ".join(notes) if notes else "") + ":"


def _choice_line(c: dict, priced: bool) -> str:
    """One choice: where, slots (and GPUs), the policy, its figure, against lru's (and one GPU's), then the
    limit and the oracles."""
    run = c["run"]
    where = "" if run is None else f"{'-' if run.budget_gib is None else f'{run.budget_gib:g} GiB'} {run.fmt}, "
    where += "" if c["ranks"] == 1 else f"{c['ranks']} GPUs of "
    figure = f"{c['tokens_per_s']:.1f} tok/s" if priced else counted(c["misses"], "miss", "misses")
    vs = "" if c["vs_lru"] is None else f", {c['vs_lru']:.3f}x lru's"
    vs += "" if c.get("vs_one_gpu") is None else f", {c['vs_one_gpu']:.2f}x one GPU's"
    value = {p: (f"{v:.1f}" if priced else f"{v}") for p, v in c["oracles"].items()}
    limit = f"; limit: {LIMIT} {value[LIMIT]}" if LIMIT in value else ""
    others = [f"{p} {v}" for p, v in sorted(value.items()) if p != LIMIT]
    oracles = f"; {'oracle' if len(others) == 1 else 'oracles'}: {', '.join(others)}" if others else ""
    return (f"  {where}{counted(c['slots'], 'slot')} ({100 * c['slots_frac']:.1f} %): {c['policy']} "
            f"{figure}{vs}{limit}{oracles}")


def format_choices(rows: list[Row], oracles: tuple[str, ...]) -> str:
    """The lines of `choices`: one per slot count (budget and format), '' when no deployable policy ran."""
    picks = choices(rows, oracles)
    if not picks:
        return ""
    priced = picks[0]["tokens_per_s"] is not None
    lines = [_choice_head(picks, priced)]
    order = list(dict.fromkeys(c["run"] for c in picks))  # the runs in the rows' order
    lines += [_choice_line(c, priced)
              for c in sorted(picks, key=lambda c: (order.index(c["run"]), c["slots"], c["ranks"]))]
    budgets: dict[tuple, list[dict]] = {}
    for c in picks:  # with formats: the best format and policy of each budget, where more than one format ran
        if c["run"] is not None and priced:
            budgets.setdefault((c["run"].budget_gib, c["ranks"]), []).append(c)
    for (gib, ranks), group in budgets.items():
        if len({c["run"].fmt for c in group}) > 1:
            top = max(group, key=lambda c: (c["tokens_per_s"], -c["slots"]))
            gpus = "" if ranks == 1 else f", {ranks} GPUs"
            lines.append(f"  {'-' if gib is None else f'{gib:g} GiB'}{gpus}: {top['run'].fmt} experts under "
                         f"{top['policy']}, {top['tokens_per_s']:.1f} tok/s, the most of its formats")
    return "\n".join(lines)


def format_per_layer(rows: list[Row]) -> str:
    """Hit rate per layer (rows) for every (policy, slots) (columns; policy@NxS for N GPUs of S slots)."""
    cols = sorted(rows, key=lambda x: (x.result.slots, x.result.ranks, x.result.policy))
    names = [f"{c.result.policy}@{'' if c.result.ranks == 1 else f'{c.result.ranks}x'}{c.result.slots}"
             for c in cols]
    width = max(10, *(len(n) + 1 for n in names))
    lines = ["layer" + "".join(f"{n:>{width}}" for n in names)]
    L = cols[0].result.layer_accesses.shape[0]
    for layer in range(L):
        cells = []
        for c in cols:
            acc = c.result.layer_accesses[layer]
            hit = 1.0 - c.result.layer_misses[layer] / acc if acc else float("nan")
            cells.append(f"{hit:>{width}.4f}")
        lines.append(f"{layer:<5}" + "".join(cells))
    return "\n".join(lines)


def plot_hit_rate(rows: list[Row], path: str, title: str = "") -> None:
    """PNG: hit rate against slots (a GPU), one line per policy (and rank count), Belady dashed as the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy, ranks in sorted({(r.result.policy, r.result.ranks) for r in rows}):
        pts = sorted((r.result.slots, r.result.hit_rate) for r in rows
                     if (r.result.policy, r.result.ranks) == (policy, ranks))
        xs, ys = np.array(pts).T
        style = dict(linestyle="--", color="black" if ranks == 1 else None) if policy == "belady" else {}
        label = ("belady (optimum)" if policy == "belady" else policy) + ("" if ranks == 1 else f", {ranks} GPUs")
        ax.plot(xs, ys, marker="o", label=label, **style)
    ax.set_xlabel("slots" if all(r.result.ranks == 1 for r in rows) else "slots a GPU")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "hit rate against slots", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
