"""The miss service in the cost model: copy every miss, split the misses between the link and the CPU
(hybrid), or compute every routed expert on the CPU, priced for a host.

    HostProfile: a GPU's cost model (sim.costmodel.HardwareProfile: its copy table, HBM, layer time) and
      the host's channels measured with both running at once: the link's bandwidth beside the CPU
      kernels, the CPU kernels' read bandwidth beside the link and alone, the hand-off round trip
    HostProfile.costs(expert_bytes) -> ChannelCosts -> MissSplit (expertcache.split): the table the
      replay splits each call's misses by, for "hybrid"; MissSplit.copy() / .cpu() for the others
    replay with that split -> hist [L, Q + 1] of misses a call
    -> estimate_service: per call the GPU part (estimate_decode's compute: the layer's weight reads
       at HBM speed and its fixed time) plus the misses' part, the slower channel
       (ChannelCosts.step_us(m, copies[m], the tail's share of an expert)); summed over the histogram, / tokens

Every channel's time of a call is a fixed part plus bytes over a bandwidth; a channel whose partner
has nothing to do in that call runs at its alone rate. "cpu" serves every routed expert on the CPU:
no slot is ever filled, so each call's misses are its distinct experts. Not modeled: the GPU's weight
reads skipped for the experts the CPU serves (an upper bound on the time), the CPU's own compute
limits at large batch, and contention beyond what the together-bandwidths measure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from expertcache.formats import resolve_format
from expertcache.split import MISS_SERVICES, ChannelCosts, MissSplit, tail_granule
from expertcache.words import counted
from sim.costmodel import H200_SM_COPY, HardwareProfile, ModelShape, check_hist

_MIB = 1 << 20


@dataclass(frozen=True)
class HostProfile:
    """One machine's two miss channels: `gpu` prices the GPU's part and a copy alone (its h2d table);
    link_together_gbps is the link's bandwidth while the CPU kernels read beside it, cpu_gbps /
    cpu_together_gbps the CPU kernels' weight-read bandwidth alone / beside the link, cpu_fixed_us the
    CPU's fixed time a call that serves misses (the hand-off's round trip and the kernels' start).
    `source` says where the numbers come from. The three rates and the fixed time are those of bf16
    experts; `formats` holds (format, cpu_gbps, cpu_together_gbps, link_together_gbps, cpu_fixed_us) where
    another format's CPU kernels were measured (`for_format`)."""

    name: str
    gpu: HardwareProfile
    link_together_gbps: float
    cpu_gbps: float
    cpu_together_gbps: float
    cpu_fixed_us: float
    source: str
    formats: tuple[tuple[str, float, float, float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("link_together_gbps", "cpu_gbps", "cpu_together_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not np.isfinite(v):
                raise ValueError(f"HostProfile.{name} must be a number > 0 (GB/s), got {v!r}")
        h = self.cpu_fixed_us
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not np.isfinite(h) or h < 0:
            raise ValueError(f"HostProfile.cpu_fixed_us must be a number >= 0, got {self.cpu_fixed_us!r}")

    def for_format(self, fmt: str | None) -> HostProfile:
        """This profile at the rates measured for experts of format `fmt` (as bf16's where none were)."""
        for name, cpu, cpu_together, link_together, cpu_fixed in self.formats:
            if name == fmt:
                return replace(self, cpu_gbps=cpu, cpu_together_gbps=cpu_together,
                               link_together_gbps=link_together, cpu_fixed_us=cpu_fixed)
        return self

    def with_rates(self, link_gbps: float | None = None, cpu_gbps: float | None = None) -> HostProfile:
        """This profile with the bandwidths replaced (--link-gbps, --cpu-gbps) for every format: link_gbps is
        the link's beside the CPU and alone (the GPU profile's copy table at that speed,
        HardwareProfile.at_link, so a copy alone is priced on the same link); cpu_gbps the CPU's beside the
        link, and its alone rate when that is not above it."""
        out = self if link_gbps is None and cpu_gbps is None else replace(self, formats=())  # given: every format
        if link_gbps is not None:
            out = replace(out, link_together_gbps=float(link_gbps), gpu=out.gpu.at_link(float(link_gbps)))
        if cpu_gbps is not None:
            out = replace(out, cpu_together_gbps=float(cpu_gbps), cpu_gbps=max(float(cpu_gbps), out.cpu_gbps))
        return out

    def costs(self, expert_bytes: int) -> ChannelCosts:
        """Both channels' costs of experts of `expert_bytes`: the link alone exactly as the GPU profile's
        copy table (first-copy latency, then back to back), slowed by link_together_gbps beside the CPU."""
        g = self.gpu
        per_alone = expert_bytes / (g.back_to_back_gbps * 1e3)
        fixed = max(g.single_copy_us(expert_bytes) - per_alone, 0.0)
        return ChannelCosts(fixed, expert_bytes / (self.link_together_gbps * 1e3), self.cpu_fixed_us,
                            expert_bytes / (self.cpu_together_gbps * 1e3), per_alone,
                            expert_bytes / (self.cpu_gbps * 1e3))

    def split(self, service: str, expert_bytes: int, inter: int = 0, granule: int = 0) -> MissSplit:
        """The MissSplit of `service` ("copy", "hybrid", "cpu") for experts of `expert_bytes`; hybrid with a
        tail where granule > 0 (expertcache.split.tail_granule of experts of width `inter`), as the engine
        splits them."""
        if service == "copy":
            return MissSplit.copy()
        if service == "cpu":
            return MissSplit.cpu()
        if service == "hybrid":
            return MissSplit.hybrid(self.costs(expert_bytes), inter, granule)
        raise ValueError(f"unknown miss service {service!r} (--miss-service): choose from {', '.join(MISS_SERVICES)}")

    def describe(self) -> str:
        extra = f"; other formats: {', '.join(f[0] for f in self.formats)}" if self.formats else ""
        return (f"host {self.name}{extra}: link {self.gpu.back_to_back_gbps:g} GB/s alone, {self.link_together_gbps:g} "
                f"beside the CPU; CPU kernels {self.cpu_gbps:g} GB/s alone, {self.cpu_together_gbps:g} beside "
                f"the link, {self.cpu_fixed_us:g} us fixed a call ({self.source})")


# A desktop with a 24 GB card on PCIe 4.0 x16 (about 25 GB/s) and dual-channel DDR5: assumed from
# spec sheets, not measured. The GPU: GDDR6X read at 1008 GB/s, this engine's H200 layer time; the
# copy: 8 us first-copy latency, then 25 GB/s.
DESKTOP_GPU = HardwareProfile(
    name="desktop-24gb-pcie4",
    h2d_points=((_MIB, 8.0 + _MIB / 25e3), (8 * _MIB, 8.0 + 8 * _MIB / 25e3)),
    h2d_ceiling_gbps=25.0,
    back_to_back_gbps=25.0,
    hbm_gbps=1008.0,
    layer_overhead_us=H200_SM_COPY.layer_overhead_us,
)

HOSTS: dict[str, HostProfile] = {
    # the H100 machine's host (16 Xeon cores), as the engine measures it at start (moe.engine.channels:
    # the miss copy and the CPU experts on 14 threads, alone and both at once, rotating through 2 GiB of
    # experts, the hand-off's round trip in the CPU's fixed time) for Qwen3-30B-A3B's experts in each
    # format (benchmarks/results/peer-llamacpp-ours.json, `channels`; mxfp4, not measured there, at
    # nvfp4's, whose E2M1 codes its kernel decodes alike); the GPU priced as the H200's engine (same link
    # generation)
    "h100-host": HostProfile("h100-host", H200_SM_COPY, link_together_gbps=51.0, cpu_gbps=82.3,
                             cpu_together_gbps=71.3, cpu_fixed_us=44.8,
                             source="measured together at start: the engine's miss copy and CPU experts",
                             formats=(("fp8", 50.3, 47.8, 51.2, 50.5), ("int4", 43.4, 43.3, 51.1, 51.9),
                                      ("nvfp4", 27.0, 29.9, 50.6, 58.4), ("mxfp4", 27.0, 29.9, 50.6, 58.4))),
    "desktop": HostProfile("desktop", DESKTOP_GPU, link_together_gbps=24.0, cpu_gbps=65.0,
                           cpu_together_gbps=45.0, cpu_fixed_us=15.0,
                           source="assumed: PCIe 4.0 x16, dual-channel DDR5, spec sheets"),
}
DEFAULT_HOST = "h100-host"


def check_services(text: str) -> tuple[str, ...]:
    """The distinct names of --miss-service, each a known service; raises ValueError naming the flag."""
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [n for n in names if n not in MISS_SERVICES]
    if not names or bad:
        raise ValueError(f"--miss-service takes comma-separated services from {', '.join(MISS_SERVICES)}, "
                         f"got {text!r}")
    return names


@dataclass(frozen=True)
class ServiceEstimate:
    """Modeled decode speed of one service: per decode step the GPU part, the misses' part (the slower
    channel a call, less what the shared expert hides beside them with overlap), and each channel's busy
    time. copies_per_token / served_per_token: experts' worth over each channel, a tail's share of an
    expert counted on the link's side (so copies_per_token is not only admissions)."""

    service: str
    us_per_token: float
    tokens_per_s: float
    compute_us_per_token: float
    miss_us_per_token: float
    link_us_per_token: float
    cpu_us_per_token: float
    copies_per_token: float
    served_per_token: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def estimate_service(hist: np.ndarray, tokens: int, shape: ModelShape, host: HostProfile, split: MissSplit, *,
                     batch: int = 1, policy: str | None = None,
                     split_hist: np.ndarray | None = None, overlap: bool = False) -> ServiceEstimate:
    """Modeled decode time of a replay under `split` on `host` (module docstring). hist: the replay's
    [L, batch * top_k + 1] calls by miss count (every miss, served or copied); split_hist: its calls by
    (misses, copies) [Q + 1, Q + 1] (ReplayResult.split_hist), which holds the copies a filling pool
    added; without it each call copies split.copies[m]. overlap: the shared expert runs on the side
    stream beside the misses' channels (moe.kernels.plan), so a call with misses exposes only what of
    them exceeds it, as sim.costmodel.estimate_decode models the copy. Raises ValueError naming the bad
    argument."""
    check_hist(hist, tokens, shape, batch)
    g = host.gpu
    compute = (shape.layer_read_bytes(batch) / (g.hbm_gbps * 1e3) + g.layer_overhead_us
               + g.policy_call_us(policy, shape.num_experts))
    costs = host.costs(shape.expert_bytes)
    if split_hist is None:
        m = np.arange(hist.shape[1])
        c = split.copies[m]
        counts = hist.astype(np.float64).sum(axis=0)
    else:
        m, c = np.nonzero(split_hist)
        counts = split_hist[m, c].astype(np.float64)
        if counts.sum() != hist.sum() or (c > m).any():
            raise ValueError("split_hist must count the calls of hist by (misses, copies <= misses)")
    mm = np.minimum(m, split.copies.shape[0] - 1)
    tail = np.where((c == split.copies[mm]) & (c < m), split.link_rows[mm], 0)  # a split expert's rows on the link
    f = tail / split.inter if split.inter else np.zeros(np.shape(m))
    step = costs.step_us(m, c, f)
    if overlap:
        shared = shape.shared_bytes / (g.hbm_gbps * 1e3)
        step = np.where(step > 0, np.maximum(step, shared) - shared, 0.0)
    link = costs.link_us(c + f, alone=(m - c - f) <= 0)
    cpu = costs.cpu_us(m - c - f, alone=(c + f) <= 0)
    compute_t = float(counts.sum()) * compute / tokens
    miss_t = float(counts @ step) / tokens
    us = compute_t + miss_t
    return ServiceEstimate(split.service, us, batch * 1e6 / us, compute_t, miss_t, float(counts @ link) / tokens,
                           float(counts @ cpu) / tokens, float(counts @ (c + f)) / tokens,
                           float(counts @ (m - c - f)) / tokens)


@dataclass(frozen=True)
class ServiceRow:
    """One (run, policy, slots) priced under each service that ran: estimates by service name.
    run: the sim.budget.FormatRun of a budget row, None for the plain report."""

    policy: str
    slots: int
    run: object
    estimates: dict

    def ratio(self, service: str, base: str = "copy") -> float | None:
        a, b = self.estimates.get(service), self.estimates.get(base)
        return None if a is None or b is None else a.tokens_per_s / b.tokens_per_s

    def to_dict(self) -> dict:
        run = self.run
        return {"policy": self.policy, "slots": self.slots,
                **({} if run is None else {"format": run.fmt, "moe_cache_gb": run.budget_gib}),
                **{f"{name}": est.to_dict() for name, est in self.estimates.items()}}


def service_rows(results_by: dict, shape: ModelShape, host: HostProfile, services: tuple[str, ...],
                 policies: list[str], slots: list[int], run: object = None, batch: int = 1) -> list[ServiceRow]:
    """A ServiceRow per (policy, slots) whose every service ran: results_by[(service, policy, slots)] is
    that replay (the copy service's is the plain sweep's)."""
    rows = []
    for policy in policies:
        for s in slots:
            got = {sv: results_by.get((sv, policy, s)) for sv in services}
            if any(r is None for r in got.values()):
                continue
            ests = {sv: estimate_service(r.hist, r.tokens, shape, host, split_for(host, sv, shape, run),
                                         batch=batch, policy=policy, split_hist=r.split_hist)
                    for sv, r in got.items()}
            rows.append(ServiceRow(policy, s, run, ests))
    return rows


def split_for(host: HostProfile, service: str, shape: ModelShape, run: object = None) -> MissSplit:
    """host.split of `service` for `shape`'s experts, with the tail the engine would cut them by: their format
    is run.fmt (a sim.budget.FormatRun), bf16 without a run."""
    granule = tail_granule(resolve_format("bf16" if run is None else run.fmt), shape.expert_intermediate)
    return host.split(service, shape.expert_bytes, shape.expert_intermediate if granule else 0, granule)


def _where(row: ServiceRow) -> str:
    run = row.run
    if run is None:
        return counted(row.slots, "slot")
    return f"{'-' if run.budget_gib is None else f'{run.budget_gib:g} GiB'} {run.fmt} {counted(row.slots, 'slot')}"


def format_service_table(rows: list[ServiceRow], host: HostProfile, services: tuple[str, ...]) -> str:
    """Modeled tok/s by miss service, one line per (run, policy, slots), with hybrid's channels."""
    head = [f"miss service, modeled on {host.describe()}:"]
    cols = "".join(f"{sv + ' tok/s':>14}" for sv in services)
    head.append(f"  {'where':<28}{'policy':<12}{cols}{'vs copy':>9}{'copied/tok':>12}{'CPU/tok':>9}")
    lines = []
    best = [sv for sv in services if sv != "copy"]
    for r in rows:
        vals = "".join(f"{r.estimates[sv].tokens_per_s:>14.1f}" for sv in services)
        pick = max(best, key=lambda sv: r.estimates[sv].tokens_per_s) if best else "copy"
        ratio = r.ratio(pick)
        est = r.estimates[pick]
        lines.append(f"  {_where(r):<28}{r.policy:<12}{vals}"
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>9}{est.copies_per_token:>12.1f}"
                     f"{est.served_per_token:>9.1f}")
    note = (f"  (vs copy, copied/tok and CPU/tok: of the best of {', '.join(best)}; "
            "tok/s = rows * 1e6 / modeled us a decode step)") if best else ""
    return "\n".join(head + lines + ([note] if note else []))


def format_service_choices(rows: list[ServiceRow], oracles: tuple[str, ...]) -> str:
    """Per (run, slots): the faster service and policy a user would deploy (never an oracle), against
    copy with the same policy and against the best copy row."""
    groups: dict[tuple, list[ServiceRow]] = {}
    for r in rows:
        if r.policy not in oracles:
            groups.setdefault((id(r.run), r.slots), []).append(r)
    if not groups:
        return ""
    lines = ["choice of miss service by modeled tok/s (never an oracle):"]
    for group in groups.values():
        cands = [(est.tokens_per_s, sv, r) for r in group for sv, est in r.estimates.items()]
        tps, sv, r = max(cands, key=lambda t: (t[0], t[1] == "copy"))
        copies = [(r2.estimates["copy"].tokens_per_s, r2) for r2 in group if "copy" in r2.estimates]
        vs = ""
        if copies and sv != "copy":
            ctps, cr = max(copies, key=lambda t: t[0])
            vs = f", {tps / ctps:.2f}x the best copy ({cr.policy}, {ctps:.1f})"
        lines.append(f"  {_where(r)}: {sv} with {r.policy}, {tps:.1f} tok/s{vs}")
    return "\n".join(lines)
