"""Expert formats at one VRAM budget: `--expert-format`, `--moe-cache-gb`, `--expert-shape`.

    expert shape (H, I): the trace's meta (hidden_size, moe_intermediate_size) or --expert-shape H,I
    --expert-format F[,F...]  -> bytes per expert fmt.expert_bytes(H, I)       (expertcache.formats)
    --moe-cache-gb G[,G...]   -> slots of each (G, format) = slots_for_budget(G, fmt, H, I);
                                 L*E when the budget holds every expert (the row says "all
                                 experts fit"), refused below the trace's largest call
    -> FormatRun per (budget, format): its slot counts, bytes per expert and the ModelShape that
       prices its misses (routed experts at the format's bytes; router and shared expert in bf16)

Without --expert-format or --moe-cache-gb the simulator prices meta.expert_bytes exactly as before
and its report is unchanged. Errors are BudgetError naming the flag or meta field and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from expertcache.formats import FormatError, format_names, get_format, gib_at_least, slots_for_budget
from expertcache.words import counted
from sim.costmodel import GENERIC_HIDDEN, SHAPES, ModelShape, match_shape, shape_for_meta
from sim.trace import Trace, format_bytes


class BudgetError(ValueError):
    """A bad --expert-format / --moe-cache-gb / --expert-shape, or a trace they cannot price."""


@dataclass(frozen=True)
class BudgetFlags:
    """The checked flags: formats None when --expert-format is absent (the trace's format is used
    with a budget), budgets None without --moe-cache-gb, shape None without --expert-shape."""

    formats: tuple[str, ...] | None
    budgets: tuple[float, ...] | None
    shape: tuple[int, int] | None

    @property
    def active(self) -> bool:
        """True when the report gets per-format rows."""
        return self.formats is not None or self.budgets is not None


@dataclass(frozen=True)
class FormatRun:
    """One (budget, format) of a trace. budget_gib is None when the slots come from --slots or
    --slots-frac; all_fit: the budget holds more than the L*E experts, so slots = (L*E,).
    expert_bytes and shape are None for bf16 of a trace with no known size (prices shown as -)."""

    fmt: str
    expert_bytes: int | None
    budget_gib: float | None
    slots: tuple[int, ...]
    all_fit: bool
    shape: ModelShape | None


def _items(text: str, flag: str, example: str) -> list[str]:
    items = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not items:
        raise BudgetError(f"{flag} names nothing (got {text!r}): e.g. {flag} {example}")
    return items


def parse_flags(formats: str | None, budgets: str | None, shape: str | None) -> BudgetFlags:
    """Check --expert-format (names in order, duplicates dropped), --moe-cache-gb (GiB > 0, finite)
    and --expert-shape (two integers >= 1). Raises BudgetError naming the flag."""
    fmts = None
    if formats is not None:
        fmts = tuple(_items(formats, "--expert-format", "nvfp4,bf16"))
        bad = [f for f in fmts if f not in format_names()]
        if bad:
            raise BudgetError(f"--expert-format {bad[0]!r} is unknown: choose from "
                              f"{', '.join(format_names())}")
    gbs = None
    if budgets is not None:
        items = _items(budgets, "--moe-cache-gb", "8")
        try:
            gbs = tuple(dict.fromkeys(float(v) for v in items))
        except ValueError:
            raise BudgetError(f"--moe-cache-gb takes comma-separated GiB, got {budgets!r}: e.g. "
                              f"--moe-cache-gb 8 or 4,8,16") from None
        if not all(0 < g < math.inf for g in gbs):
            raise BudgetError(f"--moe-cache-gb needs GiB > 0, got {budgets!r}: e.g. --moe-cache-gb 8")
    hi = None
    if shape is not None:
        parts = [v.strip() for v in shape.split(",")]
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise BudgetError(f"--expert-shape takes H,I (hidden size, MoE intermediate size), got "
                              f"{shape!r}: e.g. --expert-shape 2048,768 for Qwen3-30B-A3B")
        hi = (int(parts[0]), int(parts[1]))
    return BudgetFlags(fmts, gbs, hi)


def expert_shape(name: str, trace: Trace, flag: tuple[int, int] | None) -> tuple[int, int] | None:
    """(H, I) from the trace's meta or --expert-shape (None: neither). Raises BudgetError when they
    differ, or when --expert-shape gives an expert whose bytes in no format are meta.expert_bytes."""
    meta = trace.meta.expert_shape
    if flag is None or meta is None:
        if flag is not None and trace.meta.expert_bytes is not None:
            sizes = format_bytes(*flag)
            if trace.meta.expert_bytes not in sizes.values():
                raise BudgetError(
                    f"{name}: meta.expert_bytes is {trace.meta.expert_bytes:,} but --expert-shape "
                    f"{flag[0]},{flag[1]} gives {', '.join(f'{n} {b:,}' for n, b in sizes.items())}: "
                    f"give the shape of the model the trace was recorded on")
        return flag or meta
    if flag != meta:
        raise BudgetError(f"{name}: --expert-shape {flag[0]},{flag[1]} differs from the trace's "
                          f"meta.hidden_size {meta[0]}, meta.moe_intermediate_size {meta[1]}: drop "
                          f"--expert-shape (the meta has it) or fix the meta")
    return meta


def recorded_format(trace: Trace, shape: tuple[int, int]) -> str:
    """The format whose expert bytes are meta.expert_bytes for this shape; bf16 when none is."""
    sizes = format_bytes(*shape)
    return next((n for n, b in sizes.items() if b == trace.meta.expert_bytes), "bf16")


def pricing_shape(trace: Trace, shape: tuple[int, int] | None, expert_bytes: int | None) -> ModelShape | None:
    """The cost model's shape with routed experts of `expert_bytes`: the built-in entry of
    sim.costmodel.SHAPES when it matches the trace and (H, I) (its shared expert included), else
    a plain one of (H, I) without a shared expert. Without (H, I): meta.expert_bytes as before."""
    m = trace.meta
    try:
        if shape is None:
            return shape_for_meta(m.model, m.num_layers, m.num_experts, m.top_k, m.expert_bytes)
        try:
            base = shape_for_meta(m.model, m.num_layers, m.num_experts, m.top_k, None)
        except ValueError:
            base = None
        if base is None or (base.hidden, base.expert_intermediate) != shape:
            base = ModelShape(m.num_layers, m.num_experts, m.top_k, *shape)
        return replace(base, routed_expert_bytes=expert_bytes)
    except ValueError:
        return None


def trace_shape(trace: Trace, flag: tuple[int, int] | None = None) -> ModelShape | None:
    """The shape that prices a trace without format flags: pricing_shape at the meta's (H, I), else
    --expert-shape's (`flag`, checked by expert_shape), and meta.expert_bytes (bf16's when null); with
    neither, meta.expert_bytes and sim.costmodel.shape_for_meta's assumption (describe_pricing says which)."""
    shape = trace.meta.expert_shape or flag
    nbytes = trace.meta.expert_bytes
    if shape is not None and nbytes is None:
        nbytes = get_format("bf16").expert_bytes(*shape)
    return pricing_shape(trace, shape, nbytes)


def _budget_slots(name: str, fmt: str, gib: float, shape: tuple[int, int], total: int,
                  need: int) -> tuple[int, bool]:
    """(slots, all_fit) of `fmt` at `gib`. Raises BudgetError naming --moe-cache-gb."""
    f = get_format(fmt)
    try:
        slots = slots_for_budget(gib, f, *shape)
    except FormatError as exc:
        raise BudgetError(f"{name}: {exc}") from None
    if slots < need:
        per = f.expert_bytes(*shape)
        raise BudgetError(f"{name}: --moe-cache-gb {gib:g} holds {counted(slots, fmt + ' expert')} of {per:,} "
                          f"bytes, fewer than the {need} distinct experts one call of this trace "
                          f"asks for: give --moe-cache-gb >= {gib_at_least(need * per)}")
    return min(slots, total), slots >= total


def plan_runs(name: str, trace: Trace, flags: BudgetFlags, slots: list[int] | None,
              need: int) -> list[FormatRun]:
    """The FormatRuns of one trace: per budget then format with --moe-cache-gb, else one per format
    at `slots` (from --slots / --slots-frac). need: the trace's largest call (min_slots).

    Raises BudgetError naming --expert-shape when a budget or a format other than bf16 needs the
    expert's shape and neither the meta nor the flag gives it, --expert-format for a shape the
    format cannot store, and --moe-cache-gb for a budget below the trace's largest call.
    """
    shape = expert_shape(name, trace, flags.shape)
    formats = flags.formats or (recorded_format(trace, shape) if shape else "bf16",)
    if shape is None and (flags.budgets is not None or set(formats) - {"bf16"}):
        what = "--moe-cache-gb" if flags.budgets is not None else f"--expert-format {','.join(formats)}"
        raise BudgetError(f"{name}: {what} needs the routed expert's shape, which the trace's meta "
                          f"does not give (hidden_size, moe_intermediate_size): give --expert-shape "
                          f"H,I, e.g. --expert-shape 2048,768 for Qwen3-30B-A3B")
    sizes = format_bytes(*shape) if shape else {}
    for fmt in formats:
        if shape and fmt not in sizes:
            try:
                get_format(fmt).expert_bytes(*shape)
            except FormatError as exc:
                why = str(exc).replace("--moe-expert-format", "--expert-format")
                raise BudgetError(f"{name}: --expert-format {fmt}: {why}") from None
    total = trace.num_layers * trace.num_experts
    runs = []
    for gib in flags.budgets or (None,):
        for fmt in formats:
            nbytes = sizes.get(fmt)
            ps = pricing_shape(trace, shape, nbytes)
            if nbytes is None and ps is not None:
                nbytes = ps.expert_bytes  # bf16 without a shape: meta.expert_bytes or SHAPES
            if gib is None:
                runs.append(FormatRun(fmt, nbytes, None, tuple(slots or ()), False, ps))
            else:
                n, fit = _budget_slots(name, fmt, gib, shape, total, need)  # type: ignore[arg-type]
                runs.append(FormatRun(fmt, nbytes, gib, (n,), fit, ps))
    return runs


def describe(runs: list[FormatRun], trace: Trace, flag: tuple[int, int] | None) -> str:
    """One line for the report's title: the expert shape, where it came from, what is priced."""
    shape = trace.meta.expert_shape or flag
    if shape is None:
        return "expert formats: bf16 at the trace's expert_bytes (no expert shape)"
    where = "trace meta" if trace.meta.expert_shape else "--expert-shape"
    sizes = ", ".join(dict.fromkeys(f"{r.fmt} {r.expert_bytes:,} B" for r in runs))
    return (f"expert formats: hidden {shape[0]}, intermediate {shape[1]} ({where}); {sizes} per "
            f"routed expert; router and shared expert priced in bf16")


def describe_pricing(trace: Trace, flag: tuple[int, int] | None) -> str | None:
    """One line for the report's title saying what prices the misses when the trace's meta gives no expert
    shape (hidden_size, moe_intermediate_size): --expert-shape's, a released model's of the same E and k
    (sim.costmodel.match_shape), a generic one at meta.expert_bytes, or nothing. None when the meta has one."""
    m = trace.meta
    if m.expert_shape is not None:
        return None
    if flag is not None:
        nbytes = m.expert_bytes or get_format("bf16").expert_bytes(*flag)
        return (f"expert shape: hidden {flag[0]} x intermediate {flag[1]} (--expert-shape), {nbytes:,} B per "
                f"routed expert ({'meta.expert_bytes' if m.expert_bytes else 'bf16'})")
    where = ("the trace's meta has no hidden_size / moe_intermediate_size" if m.expert_bytes
             else "the trace's meta has no expert_bytes, hidden_size or moe_intermediate_size")
    name = match_shape(m.model, m.num_layers, m.num_experts, m.top_k)
    if name is not None:
        s = SHAPES[name]
        shared = f", a shared expert of intermediate {s.shared_intermediate}" if s.shared_intermediate else ""
        nbytes = f"{m.expert_bytes:,} B (meta.expert_bytes)" if m.expert_bytes else f"{s.expert_bytes:,} B (bf16)"
        fix = "" if m.expert_bytes else ": give --expert-shape H,I if the trace is of another model"
        return (f"expert shape assumed: {name}'s, the built-in model with {m.num_experts} experts top-{m.top_k}: "
                f"hidden {s.hidden} x intermediate {s.expert_intermediate}{shared}, {nbytes} per routed expert, "
                f"as {where}{fix}")
    if m.expert_bytes is not None:
        return (f"expert shape assumed: {m.expert_bytes:,} B per routed expert (meta.expert_bytes) and a hidden "
                f"size of {GENERIC_HIDDEN} for the router's bytes, as {where} and no built-in model has "
                f"{m.num_experts} experts top-{m.top_k}")
    return (f"not priced: {where} and no built-in model has {m.num_experts} experts top-{m.top_k}, so there "
            f"is no tok/s: give --expert-shape H,I to price the misses")
