"""Routed-path execution plans and the side-stream overlap decision, all decidable on the CPU.

    tokens, MoEConfig, num_sms ──make_routed_plan──► RoutedPlan (family, tokens, grid, co-residency, launch)
    RoutedPlan ──plan_supports_aux_stream_overlap──► bool
    phase, device, tp_size, RoutedPlan, hybrid ──decode_side_applies──► (applies, reason)
    MoEConfig.copy_overlap + decode_side_applies ──select_overlap_mode──► (OverlapMode, reason)

Routed GEMM families (the routed kernels receive slot ids, never expert ids):

* "gemv-slots" (1..GEMV_MAX_TOKENS tokens, `moe.kernels.routed.routed_experts`): two launches of
  independent CTAs. gate_up: one CTA per (token, routed slot j, GEMV_BLOCK_I rows of gate and of
  up), grid = (tokens * k, ceil(I / GEMV_BLOCK_I)), the plan's `grid`; a slot routed by several
  tokens is read once per token (the repeats meet in L2). down: one CTA per (token, GEMV_BLOCK_H
  output rows), grid = (tokens, ceil(H / GEMV_BLOCK_H)). No grid-wide barrier, so neither
  launch needs co-residency and side work may hold SMs.
  The shared expert runs through the same two kernels as a one-slot pool (k = 1, slots all 0,
  its gate computed inside the gate_up launch): grids (tokens, ceil(Is / GEMV_BLOCK_I)) and
  (tokens, ceil(H / GEMV_BLOCK_H)); the routed down launch adds its output and writes the layer's
  output in the model dtype (the combine). The router before them (`moe.kernels.router`) is one launch of
  grid (tokens, ceil(E / block_e)) whose last-arriving program per token selects the top-k: an
  arrival counter, but no program ever waits for another, so it needs no co-residency either.
  A decode layer is 7 launches: router, ensure, miss copy, routed gate_up, routed down (+ combine),
  and the shared expert's 2; overlapping, those 2 and (MoEConfig.early_hits) the resident experts'
  gate_up run on the side stream: 8 launches.
* "grouped-persistent" (more tokens): a persistent grouped GEMM, grid = (min(num_sms, tiles),),
  each CTA looping over (expert, M tile, N tile) work items on its own; no grid-wide barrier.

A family whose kernel synchronises the whole grid (for example a fused gate_up -> down with a grid
barrier between them) must set `needs_coresident_grid=True`. Such a plan allows the side stream only
when launched cooperatively: otherwise CTAs spinning at the barrier wait for CTAs that cannot become
resident while the side stream holds SMs, and the step deadlocks.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from moe.model.config import COPY_OVERLAP_ENV, MoEConfig

GEMV_MAX_TOKENS = 8
GEMV_BLOCK_I = 1  # gemv-slots gate_up launch: rows of gate (and as many of up) per CTA
GEMV_BLOCK_H = 2  # gemv-slots down launch: output rows per CTA
TILE_N = 128  # output rows per CTA tile (grouped-persistent)
TILE_M = 64  # token rows per CTA tile (grouped-persistent)
PHASES = ("decode", "prefill")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class OverlapMode(enum.Enum):
    """How the shared expert runs relative to the miss copy and routed GEMM."""

    NONE = "none"  # shared expert in line on the compute stream
    SIDE_STREAM = "side_stream"  # shared expert on the dedicated side stream, forked and joined by events


@dataclass(frozen=True)
class RoutedPlan:
    """One launch of the routed GEMM.

    family: kernel family name. tokens: rows routed in this call (>= 1). grid: CTA grid, every
    dimension >= 1. needs_coresident_grid: the kernel has a grid-wide barrier, so all its CTAs must be
    resident at once. cooperative_launch: launched with cudaLaunchCooperativeKernel, which guarantees that.

    Raises ValueError naming the field on any invalid value.
    """

    family: str
    tokens: int
    grid: tuple[int, ...]
    needs_coresident_grid: bool
    cooperative_launch: bool

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"RoutedPlan.family must be a non-empty str, got {self.family!r}")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"RoutedPlan.tokens must be an int >= 1, got {self.tokens!r}")
        if not isinstance(self.grid, tuple) or not 1 <= len(self.grid) <= 3 or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in self.grid
        ):
            raise ValueError(f"RoutedPlan.grid must be a tuple of 1-3 ints >= 1, got {self.grid!r}")
        for name in ("needs_coresident_grid", "cooperative_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RoutedPlan.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def num_ctas(self) -> int:
        return math.prod(self.grid)


def plan_supports_aux_stream_overlap(plan: RoutedPlan) -> bool:
    """True when the plan's kernel may run while side-stream work holds SMs.

    | needs_coresident_grid | cooperative_launch | overlap |
    |-----------------------|--------------------|---------|
    | False                 | any                | yes     |
    | True                  | True               | yes     |
    | True                  | False              | no (grid barrier can deadlock) |
    """
    return not plan.needs_coresident_grid or plan.cooperative_launch


def make_routed_plan(tokens: int, cfg: MoEConfig, num_sms: int = 132) -> RoutedPlan:
    """Choose the routed GEMM plan for `tokens` rows of `cfg` on a GPU with `num_sms` SMs. O(1).

    Raises ValueError naming `tokens` or `num_sms` when either is < 1.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"make_routed_plan: tokens must be an int >= 1, got {tokens!r}")
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"make_routed_plan: num_sms must be an int >= 1, got {num_sms!r}")
    if tokens <= GEMV_MAX_TOKENS:
        grid = (tokens * cfg.top_k, -(-cfg.expert_intermediate // GEMV_BLOCK_I))  # gate_up launch
        return RoutedPlan("gemv-slots", tokens, grid, False, False)
    experts_in_call = min(tokens * cfg.top_k, cfg.num_experts)
    n_tiles = -(-max(2 * cfg.expert_intermediate, cfg.hidden) // TILE_N)
    m_tiles = -(-(tokens * cfg.top_k) // TILE_M) + experts_in_call  # upper bound over the expert split
    work = m_tiles * n_tiles
    return RoutedPlan("grouped-persistent", tokens, (min(num_sms, work),), False, False)


def decode_side_applies(
    phase: str, device: str, tp_size: int, plan: RoutedPlan, *, hybrid: bool = False
) -> tuple[bool, str]:
    """Whether the decode side stream (shared expert beside the miss copy) applies; (applies, reason).

    Declines, in this order: prefill (it streams whole layers with the copy engines), a CPU device,
    hybrid CPU/GPU decode, tensor parallel size > 1, and a plan without aux-stream overlap support.
    Raises ValueError naming `phase`, `device` or `tp_size` for values outside their domain.
    """
    if phase not in PHASES:
        raise ValueError(f"decode_side_applies: phase={phase!r} is not one of {PHASES}")
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"decode_side_applies: device={device!r} is not 'cpu', 'cuda' or 'cuda:N'")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"decode_side_applies: tp_size must be an int >= 1, got {tp_size!r}")
    if phase == "prefill":
        return False, "prefill streams whole layers with the copy engines; the side stream is decode only"
    if device == "cpu":
        return False, "device is cpu: there is no side stream"
    if hybrid:
        return False, "hybrid CPU/GPU decode: the shared expert does not run beside a GPU miss copy"
    if tp_size > 1:
        return False, f"tp_size={tp_size}: the side stream supports tensor parallel size 1 only"
    if not plan_supports_aux_stream_overlap(plan):
        return False, (f"routed plan {plan.family!r} needs a co-resident grid and is not launched "
                       "cooperatively: side work could deadlock its grid barrier")
    return True, "decode on a GPU with an overlap-safe routed plan"


def select_overlap_mode(
    cfg: MoEConfig, phase: str, device: str, tp_size: int, plan: RoutedPlan, *, hybrid: bool = False
) -> tuple[OverlapMode, str]:
    """The overlap mode for one call: SIDE_STREAM when `cfg.copy_overlap` is on, the block has work for
    the side stream (a shared expert, or the resident experts' gate_up: `cfg.early_hits` without
    `cfg.hits_first`; MoELayer passes its resolved early_hits, and None here counts as on) and
    `decode_side_applies` agrees."""
    early = cfg.early_hits is not False
    if not cfg.has_shared_expert and (not early or cfg.hits_first):
        why = "hits_first on (the resident experts' gate_up stays on the compute stream)" if early \
            else "early_hits off"
        return OverlapMode.NONE, f"no shared expert and {why}: nothing to run on the side stream"
    if not cfg.copy_overlap:
        return OverlapMode.NONE, f"copy_overlap is off (set MoEConfig.copy_overlap or {COPY_OVERLAP_ENV}=1)"
    applies, reason = decode_side_applies(phase, device, tp_size, plan, hybrid=hybrid)
    return (OverlapMode.SIDE_STREAM if applies else OverlapMode.NONE), reason
