"""Turn replay results into the simulator's report: rows, a terminal table, JSON, a plot.

    [ReplayResult] + trace meta + HardwareProfile
    -> rows: hit rate, misses and MB copied per token, share of the LRU-to-Belady gap
       recovered, modeled us/token and tokens/s without and with the shared-expert overlap
       (both from sim.costmodel.estimate_decode: tokens/s = batch * 1e6 / us per decode step)
    -> format_table (terminal), rows as JSON, plot_hit_rate (PNG), format_per_layer
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.costmodel import H200, HardwareProfile, ModelShape, estimate_decode, shape_for_meta
from sim.replay import ReplayResult
from sim.trace import Trace


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

    def to_dict(self) -> dict:
        d = self.result.to_dict()
        d.update(slots_frac=self.slots_frac, gap_recovered=self.gap_recovered,
                 us_per_token=self.us_per_token, tokens_per_s=self.tokens_per_s,
                 us_per_token_overlap=self.us_per_token_overlap,
                 tokens_per_s_overlap=self.tokens_per_s_overlap,
                 mb_copied_per_token=self.mb_copied_per_token)
        return d


def model_shape(trace: Trace) -> ModelShape | None:
    """The cost model's shape for a trace, or None when its meta gives too little."""
    m = trace.meta
    try:
        return shape_for_meta(m.model, m.num_layers, m.num_experts, m.top_k, m.expert_bytes)
    except ValueError:
        return None


def build_rows(trace: Trace, results: list[ReplayResult],
               profile: HardwareProfile = H200) -> list[Row]:
    """One Row per result. The gap share is (lru - p) / (lru - belady) misses at the same
    slot count, when both references were replayed (1.0 when lru already equals belady)."""
    by = {(r.policy, r.slots): r for r in results}
    shape = model_shape(trace)
    total = trace.num_layers * trace.num_experts
    rows = []
    for r in results:
        lru, opt = by.get(("lru", r.slots)), by.get(("belady", r.slots))
        gap = None
        if lru is not None and opt is not None:
            width = lru.misses - opt.misses
            gap = 1.0 if width == 0 else (lru.misses - r.misses) / width
        us = tps = us_ov = tps_ov = mb = None
        if shape is not None:
            est = estimate_decode(r.hist, r.tokens, shape, profile, batch=trace.batch)
            ov = estimate_decode(r.hist, r.tokens, shape, profile, batch=trace.batch, overlap=True)
            us, tps = est.us_per_token, est.tokens_per_s
            us_ov, tps_ov = ov.us_per_token, ov.tokens_per_s
            mb = est.bytes_copied_per_token / 1e6
        rows.append(Row(r, r.slots / total, gap, us, tps, us_ov, tps_ov, mb))
    return rows


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(rows: list[Row], title: str = "") -> str:
    """A fixed-width table, one line per row, grouped by slot count."""
    head = (f"{'policy':<8} {'slots':>7} {'%exp':>5} {'hit rate':>8} {'miss/tok':>9} "
            f"{'MB/tok':>8} {'gap rec.':>8} {'us/tok':>9} {'tok/s':>8} {'tok/s ov':>8}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for row in sorted(rows, key=lambda x: (x.result.slots, x.result.policy)):
        r = row.result
        lines.append(
            f"{r.policy:<8} {r.slots:>7} {100 * row.slots_frac:>5.1f} {r.hit_rate:>8.4f} "
            f"{r.misses_per_token:>9.2f} {_fmt(row.mb_copied_per_token, '8.1f'):>8} "
            f"{_fmt(row.gap_recovered, '8.3f'):>8} {_fmt(row.us_per_token, '9.1f'):>9} "
            f"{_fmt(row.tokens_per_s, '8.1f'):>8} {_fmt(row.tokens_per_s_overlap, '8.1f'):>8}")
    return "\n".join(lines)


def format_per_layer(rows: list[Row]) -> str:
    """Hit rate per layer (rows) for every (policy, slots) (columns)."""
    cols = sorted(rows, key=lambda x: (x.result.slots, x.result.policy))
    names = [f"{c.result.policy}@{c.result.slots}" for c in cols]
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
    """PNG: hit rate against slots, one line per policy, Belady dashed as the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy in sorted({r.result.policy for r in rows}):
        pts = sorted((r.result.slots, r.result.hit_rate) for r in rows if r.result.policy == policy)
        xs, ys = np.array(pts).T
        style = dict(linestyle="--", color="black") if policy == "belady" else {}
        ax.plot(xs, ys, marker="o", label="belady (optimum)" if policy == "belady" else policy,
                **style)
    ax.set_xlabel("slots")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "hit rate against slots", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
