"""The MoE layer's launch plan: one resolver picks every launch choice of a layer, once per build.

    MoEConfig, pool slots vs L*E keys, device, SMs, copy_overlap, tp_size, miss_service
        ──resolve_launch_plan──► LaunchPlan (frozen): overlap mode + reason, CPU share, PDL, releases, prefetch,
                                 tiles
    tokens, MoEConfig, RoutedTiles ──make_routed_plan──► RoutedPlan (family, grid, co-residency)
    RoutedPlan ──plan_supports_aux_stream_overlap──► bool
    phase, device, tp_size, RoutedPlan, hybrid ──decode_side_applies──► (applies, reason)

The resolver (the shape of vLLM's `_determine_shared_experts_order`): with no shared expert and a pool
that holds every expert there is nothing to run beside the copy (INLINE); with copy_overlap off
everything runs in line; else `decode_side_applies` must accept every decode size T = 1..GEMV_MAX_TOKENS,
and the mode names what runs on the side stream: the shared expert where the block has one, and the
resident experts' gate_up ("early hits") where the pool cannot hold every expert (a full pool never
copies once warm, so there is nothing for them to hide). The releases below ("front release") apply
unless the early hits run on the side stream (beside them they made the layer slower). MoELayer
(moe.engine.layer) launches from the plan only; docs/layer.md has the launch diagram and the figures.

Routed GEMM family (the routed kernels receive slot ids, never expert ids): "gemv-slots", 1..GEMV_MAX_TOKENS
tokens (`moe.kernels.routed`): two launches of independent programs, gate_up grid (T * k, ceil(I /
block_i)) and down grid (T, ceil(H / block_h)); no grid-wide barrier, so neither needs co-residency
and side work may hold SMs. Prefill does not use these kernels (moe.engine.backends.moe_prefill).
A family whose kernel synchronises the whole grid must set `needs_coresident_grid=True`; such a plan
allows the side stream only when launched cooperatively, else CTAs spinning at the barrier wait for
CTAs that cannot become resident while the side stream holds SMs, and the step deadlocks.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from expertcache.split import MISS_SERVICES
from moe.kernels.tiles import GEMV_BLOCK_H, GEMV_BLOCK_I, MmaTiles, RoutedTiles, RouterTiles
from moe.model.config import COPY_OVERLAP_ENV, ROUTED_MMA_ENV, MoEConfig

__all__ = ["GEMV_BLOCK_H", "GEMV_BLOCK_I", "GEMV_MAX_TOKENS", "LaunchPlan", "OverlapMode", "RoutedPlan",
           "decode_side_applies", "make_routed_plan", "plan_supports_aux_stream_overlap", "resolve_launch_plan"]

GEMV_MAX_TOKENS = 8  # decode sizes the layer's kernels serve
DOWN_PREFETCH = 4  # experts whose down tiles a down program loads before its wait: min(this, k) ...
FRONT_RELEASE_PREFETCH = 2  # ... and min(this, k) when the down also releases the next router
HITS_PROGRAMS_PER_SM = 8  # the early hits' persistent grid: programs per SM (16 warps of the 2-warp tile)
PHASES = ("decode", "prefill")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
DEFAULT_ROUTER_TILES, DEFAULT_ROUTED_TILES = RouterTiles(), RoutedTiles()  # the tuned tiles (docs/layer.md)
# The routed tiles of a quantized expert format (fp8, nvfp4, mxfp4, int4): more rows per program, so
# that one pass over the input chunk serves more of the (smaller) weight rows.
QUANTIZED_ROUTED_TILES = RoutedTiles(block_i=2, chunk_h=1024, warps_gate_up=4, block_h=4, chunk_i=512, warps_down=4)
DEFAULT_MMA_TILES = MmaTiles()  # the tensor-core routed kernels' (moe.kernels.routed_mma), where the plan runs them


class OverlapMode(enum.Enum):
    """What runs where: every launch on the compute stream, or some on the side stream beside the
    router, ensure and miss copy (forked by an event before them, joined before the routed down)."""

    INLINE = "inline"  # everything on the compute stream, the shared expert first
    SHARED_ON_SIDE = "shared_on_side"  # the shared expert's 2 launches on the side stream
    HITS_ON_SIDE = "hits_on_side"  # the resident experts' gate_up on the side stream (no shared expert)
    SHARED_AND_HITS_ON_SIDE = "shared_and_hits_on_side"  # both

    @property
    def side_stream(self) -> bool:
        return self is not OverlapMode.INLINE

    @property
    def shared_on_side(self) -> bool:
        return self in (OverlapMode.SHARED_ON_SIDE, OverlapMode.SHARED_AND_HITS_ON_SIDE)

    @property
    def hits_on_side(self) -> bool:
        return self in (OverlapMode.HITS_ON_SIDE, OverlapMode.SHARED_AND_HITS_ON_SIDE)


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch choice of one MoE layer, resolved once (resolve_launch_plan) and read by each call.

    mode / reason: the OverlapMode and why it was chosen (the first check that declined, or the one
    that accepted). pdl: the router, ensure, post (a miss split) and miss copy are programmatic dependent
    launches (each waits for its predecessor before it reads anything; the routed gate_up and down, and a
    miss split's tail zeroing and wait, always are on CUDA). The releases, all with pdl and none changing a
    bit (every launch still waits for its predecessor before reading what it wrote):
      router_early_weights[T - 1]: a call of T tokens loads the router's weight rows before its wait;
        True only where they fit in registers (RouterTiles.early_weights_fit).
      front_release: the routed down lets the next programmatic launch (the next layer's router) start
        right after the down's own wait instead of at its end, and the miss copy lets the routed gate_up
        launch right after the copy's own wait.
    down_prefetch: experts whose down weight tiles each down program loads before its wait (0..k).
    hits_programs: programs of the early hits' persistent launch (room for the ensure and copy).
    cpu_share: a miss split serves some misses on the CPU: the compute stream posts them after the ensure
        and waits for the CPU's answer after the routed down, adding it there (moe.engine.handoff).
    router_tiles / routed_tiles: the tiles of the router and of every routed launch (shared expert too).
    routed_mma: None (the routed experts run routed_tiles' one-program-a-pair kernels), or the MmaTiles of
        the tensor-core kernels that run them instead (moe.kernels.routed_mma; the shared expert keeps
        routed_tiles' kernels); never with early hits or a CPU share.
    Raises ValueError naming the field.
    """

    mode: OverlapMode
    reason: str
    pdl: bool
    router_early_weights: tuple[bool, ...]
    front_release: bool
    down_prefetch: int
    hits_programs: int
    router_tiles: RouterTiles = DEFAULT_ROUTER_TILES
    routed_tiles: RoutedTiles = DEFAULT_ROUTED_TILES
    cpu_share: bool = False
    routed_mma: MmaTiles | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, OverlapMode):
            raise ValueError(f"LaunchPlan.mode must be an OverlapMode, got {self.mode!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"LaunchPlan.reason must be a non-empty str, got {self.reason!r}")
        for name in ("pdl", "front_release", "cpu_share"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LaunchPlan.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        early = self.router_early_weights
        if not (isinstance(early, tuple) and len(early) == GEMV_MAX_TOKENS and all(isinstance(v, bool) for v in early)):
            raise ValueError(f"LaunchPlan.router_early_weights must be a tuple of {GEMV_MAX_TOKENS} bools "
                             f"(one per decode size T = 1..{GEMV_MAX_TOKENS}), got {early!r}")
        for name, minimum in (("down_prefetch", 0), ("hits_programs", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"LaunchPlan.{name} must be an int >= {minimum}, got {v!r}")
        for name, cls in (("router_tiles", RouterTiles), ("routed_tiles", RoutedTiles)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"LaunchPlan.{name} must be a {cls.__name__}, "
                                 f"got {getattr(self, name)!r}")
        if self.routed_mma is not None:
            if not isinstance(self.routed_mma, MmaTiles):
                raise ValueError(f"LaunchPlan.routed_mma must be a MmaTiles or None, got {self.routed_mma!r}")
            if self.mode.hits_on_side or self.cpu_share:
                raise ValueError("LaunchPlan.routed_mma: the tensor-core routed kernels run neither early hits "
                                 f"nor a CPU share (mode {self.mode.value}, cpu_share {self.cpu_share})")

    def summary(self) -> dict:
        """The plan as plain values (for results JSON and logs)."""
        return {"mode": self.mode.value, "reason": self.reason, "pdl": self.pdl,
                "router_early_weights": list(self.router_early_weights), "front_release": self.front_release,
                "down_prefetch": self.down_prefetch,
                "hits_programs": self.hits_programs, "router_tiles": self.router_tiles.name,
                "routed_tiles": self.routed_tiles.name, "cpu_share": self.cpu_share,
                "routed_mma": None if self.routed_mma is None else self.routed_mma.name}


def resolve_launch_plan(cfg: MoEConfig, *, num_slots: int, num_keys: int, device: str, num_sms: int,
                        copy_overlap: bool, tp_size: int = 1, miss_service: str = "copy",
                        routed_mma: bool = False) -> LaunchPlan:
    """The launch plan of a decode layer of `cfg` over a pool of `num_slots` slots for `num_keys`
    (L * E) keys on `device` ("cpu", "cuda" or "cuda:N") with `num_sms` SMs. O(GEMV_MAX_TOKENS).

    copy_overlap: the user's choice (MoEConfig.copy_overlap / EXPERTCACHE_MOE_COPY_OVERLAP).
    miss_service: the miss split's service (expertcache.split.MISS_SERVICES); hybrid and cpu set cpu_share
    and need a CUDA device. Early hits apply where num_slots < num_keys and misses fill slots (not under
    cpu); the front release (front_release,
    router_early_weights where they fit, down_prefetch min(FRONT_RELEASE_PREFETCH, k)) applies
    unless the early hits run on the side stream; else down_prefetch is min(DOWN_PREFETCH, k).
    A quantized MoEConfig.expert_format launches QUANTIZED_ROUTED_TILES and prefetches nothing (its
    down dequantizes each tile as it loads it).
    routed_mma (EXPERTCACHE_ROUTED_MMA): the routed experts run the tensor-core kernels (DEFAULT_MMA_TILES),
    without early hits (the shared expert may still run on the side stream); refused with a miss
    split, whose hand-off edits the act rows those kernels keep in another layout.
    Raises ValueError naming the argument outside its domain.
    """
    for name, v, minimum in (("num_slots", num_slots, 1), ("num_keys", num_keys, 1), ("num_sms", num_sms, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"resolve_launch_plan: {name} must be an int >= {minimum}, got {v!r}")
    if not isinstance(copy_overlap, bool):
        raise ValueError(f"resolve_launch_plan: copy_overlap must be a bool, "
                         f"got {copy_overlap!r}")
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"resolve_launch_plan: device={device!r} is not 'cpu', 'cuda' or 'cuda:N'")
    if miss_service not in MISS_SERVICES:
        raise ValueError(f"resolve_launch_plan: miss_service must be one of {MISS_SERVICES}, got {miss_service!r}")
    split = miss_service != "copy"
    if not isinstance(routed_mma, bool):
        raise ValueError(f"resolve_launch_plan: routed_mma must be a bool, got {routed_mma!r}")
    if routed_mma and split:
        raise ValueError(f"resolve_launch_plan: {ROUTED_MMA_ENV}=1 (the tensor-core routed kernels) does not run with "
                         f"the {miss_service} miss service: unset it or use --moe-miss-service copy")
    if split and device == "cpu":
        raise ValueError(f"resolve_launch_plan: miss_service={miss_service!r} hands misses to a CPU worker from "
                         "a CUDA device; the CPU backend computes them in line (moe.engine.backends)")
    dense = cfg.format.dense
    router_tiles, routed_tiles = DEFAULT_ROUTER_TILES, DEFAULT_ROUTED_TILES if dense else QUANTIZED_ROUTED_TILES
    early_hits = num_slots < num_keys and miss_service != "cpu" and not routed_mma
    mode, reason = _overlap_mode(cfg, early_hits, device, tp_size, split, copy_overlap, routed_tiles)
    front = not mode.hits_on_side
    early_weights = tuple(front and router_tiles.early_weights_fit(cfg.num_experts, cfg.hidden, t)
                          for t in range(1, GEMV_MAX_TOKENS + 1))
    prefetch = min(FRONT_RELEASE_PREFETCH if front else DOWN_PREFETCH, cfg.top_k) if dense else 0
    return LaunchPlan(mode, reason, pdl=device.startswith("cuda"), router_early_weights=early_weights,
                      front_release=front, down_prefetch=prefetch,
                      hits_programs=HITS_PROGRAMS_PER_SM * num_sms, router_tiles=router_tiles,
                      routed_tiles=routed_tiles, cpu_share=split, routed_mma=DEFAULT_MMA_TILES if routed_mma else None)


def _overlap_mode(cfg: MoEConfig, early_hits: bool, device: str, tp_size: int, hybrid: bool,
                  copy_overlap: bool, tiles: RoutedTiles) -> tuple[OverlapMode, str]:
    """(mode, reason): the checks in order, the first that declines gives INLINE and its reason."""
    if not cfg.has_shared_expert and not early_hits:
        return OverlapMode.INLINE, ("no shared expert, and no early hits (the pool holds every expert, the cpu "
                                    "miss service fills no slot, or the tensor-core routed kernels run the "
                                    "experts): nothing to run on the side stream")
    if not copy_overlap:
        return OverlapMode.INLINE, f"copy_overlap is off (set MoEConfig.copy_overlap or {COPY_OVERLAP_ENV}=1)"
    for tokens in range(1, GEMV_MAX_TOKENS + 1):  # must hold at every decode size
        applies, reason = decode_side_applies("decode", device, tp_size, make_routed_plan(tokens, cfg, tiles),
                                              hybrid=hybrid)
        if not applies:
            return OverlapMode.INLINE, reason
    if cfg.has_shared_expert:
        mode = OverlapMode.SHARED_AND_HITS_ON_SIDE if early_hits else OverlapMode.SHARED_ON_SIDE
    else:
        mode = OverlapMode.HITS_ON_SIDE
    return mode, reason


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
                raise ValueError(f"RoutedPlan.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")

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


def make_routed_plan(tokens: int, cfg: MoEConfig, tiles: RoutedTiles = DEFAULT_ROUTED_TILES) -> RoutedPlan:
    """The "gemv-slots" plan of a decode call of `tokens` rows of `cfg` at `tiles`: its gate_up grid. O(1).

    Raises ValueError naming `tokens` outside 1..GEMV_MAX_TOKENS (larger calls are prefill, which
    does not use the routed kernels).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= GEMV_MAX_TOKENS:
        raise ValueError(f"make_routed_plan: tokens must be an int in 1..GEMV_MAX_TOKENS={GEMV_MAX_TOKENS} "
                         f"(the routed kernels serve decode steps only), got {tokens!r}")
    grid = tiles.gate_up_grid(tokens, cfg.top_k, cfg.hidden, cfg.expert_intermediate)
    return RoutedPlan("gemv-slots", tokens, grid, False, False)


def decode_side_applies(
    phase: str, device: str, tp_size: int, plan: RoutedPlan, *, hybrid: bool = False
) -> tuple[bool, str]:
    """Whether the decode side stream (work beside the miss copy) applies; (applies, reason).

    Declines, in this order: prefill (it streams whole layers with the copy engines), a CPU device,
    tensor parallel size > 1, and a plan without aux-stream overlap support. hybrid (a miss split serves
    misses on the CPU) changes no answer, only the reason: the side stream then runs beside the CPU
    workers too, and the CPU's share is added after the join.
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
    if tp_size > 1:
        return False, f"tp_size={tp_size}: the side stream supports tensor parallel size 1 only"
    if not plan_supports_aux_stream_overlap(plan):
        return False, (f"routed plan {plan.family!r} needs a co-resident grid and is not launched "
                       "cooperatively: side work could deadlock its grid barrier")
    if hybrid:
        return True, ("hybrid decode on a GPU with an overlap-safe routed plan: the side stream runs beside the "
                      "copy and the CPU workers; the CPU's share is added on the compute stream after the join")
    return True, "decode on a GPU with an overlap-safe routed plan"
