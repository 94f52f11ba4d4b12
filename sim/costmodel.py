"""Decode cost model: replay statistics -> modeled microseconds per token and tokens/s.

    ReplayResult.hist int64 [L, B*k + 1]   (hist[l, m] = ensure calls of layer l with m misses)
    + tokens N (decode steps) + ModelShape (per-layer weight bytes) + HardwareProfile
    -> per call: compute_us (weights read / HBM bandwidth + fixed layer overhead)
                 copy_us(m) (m experts host -> device, back to back)
                 layer_us = compute + copy            (serial)
                          = compute - shared + max(copy, shared)   (overlap, when m > 0)
    -> summed over the histogram (exact per call, never through the mean miss count), / N
    -> DecodeEstimate
    estimate_ranks: the same over R GPUs of one host (sim.ranks): hist counts calls by the slowest rank's
    misses; per call the busiest rank's routed reads, 1/R of the shared and non-MoE bytes, and two
    all-reduces (HardwareProfile.allreduce_us); R = 1 is estimate_decode

Modeled: a memory-bound decode MoE layer (router GEMV, routed experts, shared expert and any
non-MoE weights read once per call from HBM at `hbm_gbps`), a fixed per-layer overhead
under CUDA-graph replay, and the miss copy at the measured host-to-device speed: the first
expert at the single-copy latency of the measured table, each further one at the
back-to-back bandwidth. With overlap, only the shared expert can hide copy time: the routed
GEMM needs the copied weights.

Not modeled: attention, KV cache and other non-MoE layers (unless `non_moe_bytes_per_layer`
is set; every entry of SHAPES leaves it 0, so estimates cover the MoE blocks alone and the
tokens/s is an upper bound on end-to-end speed), activation traffic, GEMM compute limits at
large batch, the ensure kernel's growth with the miss count, prefetching across layers, and
contention between the copy and the GEMMs for HBM. `H200` prices a miss at the copy engine's
speeds, `H200_SM_COPY` at this engine's SM miss copy's (docs/simulator.md, "Cost model", lists
the measurements both profiles hold). At batch B every call is charged min(B*k, E) routed
experts, an upper bound when rows share experts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

import numpy as np

_MIB = 1 << 20
# One all-reduce of a decode step's hidden state (a few KiB) between GPUs of one host: the order of
# NCCL's small-message latency over NVLink, assumed until measured on two GPUs of this engine; cards
# that talk over PCIe only are slower, and `expertcache sim --allreduce-us` is how a user prices them.
ALLREDUCE_US = 10.0
ALLREDUCES_PER_LAYER = 2  # the attention output and the MoE output are summed over the ranks


def _gbps_to_bytes_per_us(gbps: float) -> float:
    """GB/s (1e9 bytes per second) -> bytes per microsecond."""
    return gbps * 1e3


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


@dataclass(frozen=True)
class HardwareProfile:
    """Host-to-device copy and HBM speeds of one GPU.

    h2d_points: measured (expert_bytes, microseconds) of one copy-engine DMA from pinned
        memory, sizes strictly increasing. Time for any size: piecewise-linear interpolation;
        past the largest point at h2d_ceiling_gbps; below the smallest point the first
        segment extended towards size 0 (its intercept reads as the fixed per-copy latency),
        never faster than the smallest point's own bandwidth.
    back_to_back_gbps: bandwidth of each further expert copied right after another.
    hbm_gbps: device memory bandwidth for reading weights.
    layer_overhead_us: fixed per-MoE-layer time beyond the weight-read floor (with lru's ensure).
    policy_us: (policy, base, per_expert): a policy's extra ensure time a call beyond lru's,
        base + per_expert * experts of a layer (markov's learning launches); absent: none.
    allreduce_us: one all-reduce of a decode step's hidden state across the GPUs of one host, as
        estimate_ranks charges it twice a layer (unused with one GPU). ALLREDUCE_US is an assumption,
        not a measurement of this engine; `expertcache sim --allreduce-us` replaces it.
    """

    name: str
    h2d_points: tuple[tuple[int, float], ...]
    h2d_ceiling_gbps: float
    back_to_back_gbps: float
    hbm_gbps: float
    layer_overhead_us: float
    policy_us: tuple[tuple[str, float, float], ...] = ()
    allreduce_us: float = ALLREDUCE_US

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name must be a non-empty string")
        points = tuple((int(s), float(t)) for s, t in self.h2d_points)
        if len(points) < 2:
            raise ValueError("h2d_points needs at least 2 (expert_bytes, us) points")
        for i, (size, us) in enumerate(points):
            _check_positive(f"h2d_points[{i}] expert_bytes", size)
            _check_positive(f"h2d_points[{i}] us", us)
            if i and (size <= points[i - 1][0] or us <= points[i - 1][1]):
                raise ValueError("h2d_points must be strictly increasing in expert_bytes and us")
        object.__setattr__(self, "h2d_points", points)
        for field in ("h2d_ceiling_gbps", "back_to_back_gbps", "hbm_gbps"):
            _check_positive(field, getattr(self, field))
        _check_positive("layer_overhead_us", self.layer_overhead_us, allow_zero=True)
        _check_positive("allreduce_us", self.allreduce_us, allow_zero=True)
        for name, base, per_expert in self.policy_us:
            _check_positive(f"policy_us[{name!r}] base", base, allow_zero=True)
            _check_positive(f"policy_us[{name!r}] per_expert", per_expert, allow_zero=True)

    def policy_call_us(self, policy: str | None, num_experts: int) -> float:
        """A policy's extra ensure microseconds a layer call beyond lru's (0 where none is held)."""
        for name, base, per_expert in self.policy_us:
            if name == policy:
                return base + per_expert * num_experts
        return 0.0

    def single_copy_us(self, expert_bytes: int) -> float:
        """Microseconds for one DMA of `expert_bytes` (> 0). Raises ValueError otherwise."""
        _check_positive("expert_bytes", expert_bytes)
        sizes = [s for s, _ in self.h2d_points]
        times = [t for _, t in self.h2d_points]
        if expert_bytes >= sizes[-1]:
            extra = expert_bytes - sizes[-1]
            return times[-1] + extra / _gbps_to_bytes_per_us(self.h2d_ceiling_gbps)
        if expert_bytes >= sizes[0]:
            return float(np.interp(expert_bytes, sizes, times))
        slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
        extended = times[0] - (sizes[0] - expert_bytes) * slope
        return max(extended, times[0] * expert_bytes / sizes[0])

    def at_link(self, gbps: float) -> HardwareProfile:
        """This profile on a link of `gbps` GB/s: every copy time times back_to_back_gbps / gbps, the
        ceiling and the back-to-back rate scaled alike; the table's shape (latency against size), the
        HBM and the layer time stay this profile's. Raises ValueError unless gbps > 0."""
        _check_positive("gbps", gbps)
        ratio = self.back_to_back_gbps / gbps
        return replace(self, name=f"{self.name}-link-{gbps:.1f}",
                       h2d_points=tuple((size, us * ratio) for size, us in self.h2d_points),
                       h2d_ceiling_gbps=self.h2d_ceiling_gbps / ratio, back_to_back_gbps=float(gbps))

    def copy_us(self, expert_bytes: int, misses: int) -> float:
        """Microseconds to copy `misses` experts of `expert_bytes` back to back: 0 for none,
        else single_copy_us(expert_bytes) + (misses - 1) * expert_bytes / back_to_back_gbps
        (later copies queue behind the first, so only the first pays the latency).
        Raises ValueError for expert_bytes <= 0 or misses < 0."""
        _check_positive("expert_bytes", expert_bytes)
        if isinstance(misses, bool) or not isinstance(misses, (int, np.integer)) or misses < 0:
            raise ValueError(f"misses must be an int >= 0, got {misses!r}")
        if misses == 0:
            return 0.0
        tail = (misses - 1) * expert_bytes / _gbps_to_bytes_per_us(self.back_to_back_gbps)
        return self.single_copy_us(expert_bytes) + tail


# The copy engine of an H200: one DMA from pinned memory per expert size (MiB), the link's ceiling
# for large copies, expert-sized copies queued back to back, and the device's read bandwidth (a
# Qwen3-Next layer's weight bytes over their device-to-device copy time). layer_overhead_us is an
# estimate, not a measurement: a graph-replayed layer runs about 7 dependent kernels on its critical
# path, each paying a launch gap, a ramp and a tail beyond the bytes it reads, plus the ensure itself;
# H200_SM_COPY replaces it by the engine's measured layer. The numbers: docs/simulator.md, "Cost model".
H200 = HardwareProfile(
    name="nvidia-h200",
    h2d_points=(
        (round(1.7 * _MIB), 41.9),
        (round(3.2 * _MIB), 70.8),
        (round(6.3 * _MIB), 130.9),
        (round(25 * _MIB), 487.8),
    ),
    h2d_ceiling_gbps=55.4,
    back_to_back_gbps=53.2,
    hbm_gbps=4219.0,
    layer_overhead_us=10.0,
    # markov's two learning launches before its ensure (the rows kernel at one warp a program):
    # bench_ensure.py at m = 0, 1650 slots, above lru: 7.04 us at 128 experts a layer, 11.02 at 512
    # (benchmarks/results/ensure-markov.json)
    policy_us=(("markov", 5.713, 0.01036),),
)


# The engine's own miss path on an H200: the SM copy kernel (expertcache.copy, 16 programs, under
# CUDA-graph replay) instead of the copy engine, its one-expert times (bytes of both banks) and the
# bandwidth of each further expert; layer_overhead_us is the MoE layer's time under graph replay with
# every expert resident, overlap off, minus its weight-read floor. The numbers: docs/simulator.md,
# "Cost model". benchmarks/bench_decode.py starts from this profile and replaces the overhead by one
# measured from a miss-free decode run of the same model.
H200_SM_COPY = replace(
    H200,
    name="nvidia-h200-sm-copy",
    h2d_points=((1782576, 40.9), (2831136, 62.2), (6606048, 139.3)),
    h2d_ceiling_gbps=50.2,
    back_to_back_gbps=50.2,
    layer_overhead_us=20.3,
)


def format_profile(profile: HardwareProfile) -> str:
    """One line describing `profile`, for reports."""
    lo, hi = profile.h2d_points[0], profile.h2d_points[-1]
    return (f"{profile.name}: H2D {lo[0] / _MIB:.1f}-{hi[0] / _MIB:.1f} MiB in "
            f"{lo[1]:.1f}-{hi[1]:.1f} us, ceiling {profile.h2d_ceiling_gbps:g} GB/s, "
            f"back-to-back {profile.back_to_back_gbps:g} GB/s; HBM {profile.hbm_gbps:g} GB/s; "
            f"layer overhead {profile.layer_overhead_us:g} us")


@dataclass(frozen=True)
class ModelShape:
    """Weights of one MoE layer (all layers alike).

    Routed and shared experts are gate, up and down projections (3 matrices of
    hidden x intermediate); the router is num_experts x hidden. routed_expert_bytes, when
    set, is the stored size of one routed expert (for example FP8 with scales), overriding
    3 * hidden * expert_intermediate * dtype_bytes. non_moe_bytes_per_layer (attention and
    other weights read per layer per token) defaults to 0: the estimate covers the MoE block.
    """

    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_intermediate: int
    shared_intermediate: int = 0
    dtype_bytes: int = 2
    non_moe_bytes_per_layer: int = 0
    routed_expert_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_experts", "top_k", "hidden", "expert_intermediate",
                      "dtype_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        for field in ("shared_intermediate", "non_moe_bytes_per_layer"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} must be an int >= 0, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        reb = self.routed_expert_bytes
        if reb is not None and (isinstance(reb, bool) or not isinstance(reb, int) or reb < 1):
            raise ValueError(f"routed_expert_bytes must be None or a positive int, got {reb!r}")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: what one miss copies."""
        if self.routed_expert_bytes is not None:
            return self.routed_expert_bytes
        return 3 * self.hidden * self.expert_intermediate * self.dtype_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared expert (0 without one)."""
        return 3 * self.hidden * self.shared_intermediate * self.dtype_bytes

    @property
    def router_bytes(self) -> int:
        return self.num_experts * self.hidden * self.dtype_bytes

    def layer_read_bytes(self, batch: int = 1) -> int:
        """Weight bytes one layer call reads at `batch` rows: router, min(batch * top_k,
        num_experts) routed experts, shared expert and non-MoE weights."""
        routed = min(batch * self.top_k, self.num_experts)
        return (self.router_bytes + routed * self.expert_bytes + self.shared_bytes
                + self.non_moe_bytes_per_layer)


# Hugging Face configs (Qwen3-Next-80B-A3B, Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B, gpt-oss-20b / 120b: their
# experts' biases, 2I + H values, are left out: 0.07 % of a bf16 expert; GLM-4.5-Air and GLM-4.5: their
# MoE layers, past the first 1 / 3 dense ones, one ungated shared expert of the routed width) and the FLAME-MoE
# training scripts (290M-1.3B: 9 layers, the first dense, hidden 1024, MoE FFN 704, two
# shared experts as one of intermediate 2 * 704). Qwen3-Next at batch 1 reads
# router 2,097,152 + 10 routed x 6,291,456 + shared 6,291,456 = 71,303,168 B = 71.3 MB (the
# shared expert's 4 KiB sigmoid gate is left out). Its expert is 6.0 MiB (6.29 MB), a little under
# the 6.3 MiB point of the copy table.
SHAPES: dict[str, ModelShape] = {
    "qwen3-next": ModelShape(48, 512, 10, 2048, 512, shared_intermediate=512),
    "qwen3-30b-a3b": ModelShape(48, 128, 8, 2048, 768),
    "mixtral-8x7b": ModelShape(32, 8, 2, 4096, 14336),
    "flame-290m": ModelShape(8, 64, 6, 1024, 704, shared_intermediate=1408),
    "gpt-oss-20b": ModelShape(24, 32, 4, 2880, 2880),
    "gpt-oss-120b": ModelShape(36, 128, 4, 2880, 2880),
    "glm-4.5-air": ModelShape(45, 128, 8, 4096, 1408, shared_intermediate=1408),
    "glm-4.5": ModelShape(89, 160, 8, 5120, 1536, shared_intermediate=1536),
    "olmoe-1b-7b": ModelShape(16, 64, 8, 2048, 1024),
}

GENERIC_HIDDEN = 2048  # hidden assumed for a shape known only by its expert bytes


def _normalized(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _best_named(names: list[str], meta_model: str) -> str:
    """The candidate whose name (or its first word) appears in meta_model, else the first."""
    model = _normalized(meta_model or "")
    for name in names:
        if _normalized(name) in model or _normalized(name.split("-")[0]) in model:
            return name
    return names[0]


def match_shape(meta_model: str, num_layers: int, num_experts: int, top_k: int) -> str | None:
    """The SHAPES entry a trace of this meta is priced as when its meta gives no expert shape: one with the
    same num_experts and top_k (the same num_layers first, then a name appearing in meta_model), or None."""
    matches = [n for n, s in SHAPES.items() if (s.num_experts, s.top_k) == (num_experts, top_k)]
    if not matches:
        return None
    same_depth = [n for n in matches if SHAPES[n].num_layers == num_layers]
    return _best_named(same_depth or matches, meta_model)


def shape_for_meta(meta_model: str, num_layers: int, num_experts: int, top_k: int,
                   expert_bytes: int | None) -> ModelShape:
    """The ModelShape for a trace's meta fields.

    A SHAPES entry with the same num_experts and top_k matches (same num_layers first, then
    a name appearing in meta_model); num_layers is then taken from the trace. A given
    expert_bytes that differs from the entry's (another dtype, scales) overrides it.
    Without a match, a generic bf16 shape of hidden GENERIC_HIDDEN carrying expert_bytes
    (router bytes from that assumed hidden, no shared expert). Raises ValueError when
    nothing matches and expert_bytes is None.
    """
    name = match_shape(meta_model, num_layers, num_experts, top_k)
    if name is not None:
        shape = replace(SHAPES[name], num_layers=num_layers)
        if expert_bytes is not None and expert_bytes != shape.expert_bytes:
            shape = replace(shape, routed_expert_bytes=int(expert_bytes))
        return shape
    if expert_bytes is None:
        raise ValueError(
            f"no entry of SHAPES has {num_experts} experts, top-{top_k} ({meta_model!r}): "
            "set the trace's meta expert_bytes or add a ModelShape to sim.costmodel.SHAPES")
    _check_positive("expert_bytes", expert_bytes)
    intermediate = max(1, round(expert_bytes / (3 * GENERIC_HIDDEN * 2)))
    return ModelShape(num_layers, num_experts, top_k, GENERIC_HIDDEN, intermediate,
                      routed_expert_bytes=int(expert_bytes))


@dataclass(frozen=True)
class DecodeEstimate:
    """Modeled decode speed. Times are microseconds per decode step (one token per row);
    copy_us_per_token is all copy time, exposed_copy_us_per_token the part not hidden
    (us_per_token = compute_us_per_token + exposed_copy_us_per_token)."""

    us_per_token: float
    tokens_per_s: float
    compute_us_per_token: float
    copy_us_per_token: float
    exposed_copy_us_per_token: float
    bytes_copied_per_token: float

    def to_dict(self) -> dict:
        return asdict(self)


def check_hist(hist: np.ndarray, tokens: int, shape: ModelShape, batch: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not isinstance(hist, np.ndarray) or not np.issubdtype(hist.dtype, np.integer):
        raise ValueError("hist must be an integer numpy array [L, B*k + 1]")
    want = (shape.num_layers, batch * shape.top_k + 1)
    if hist.shape != want:
        raise ValueError(f"hist has shape {hist.shape}, expected {want} "
                         "(shape.num_layers, batch * shape.top_k + 1): check shape and batch")
    if (hist < 0).any():
        raise ValueError("hist has negative counts")
    calls = hist.sum(axis=1)
    if (calls != tokens).any():
        raise ValueError(f"tokens = {tokens} but hist holds {calls.tolist()} calls per layer "
                         "(each decode step calls every layer once)")


def estimate_decode(hist: np.ndarray, tokens: int, shape: ModelShape,
                    profile: HardwareProfile = H200, *, batch: int = 1,
                    overlap: bool = False, policy: str | None = None) -> DecodeEstimate:
    """Modeled decode time from a replay's miss histogram.

    hist: integer [shape.num_layers, batch * shape.top_k + 1], hist[l, m] = calls of layer
        l with m misses; every row sums to `tokens` (decode steps, > 0).
    overlap: the shared expert runs on a side stream during the miss copy.
    policy: the eviction policy replayed; its extra ensure time a call (profile.policy_call_us) is
        charged to every layer call.
    Cost: O(L * Q). Raises ValueError naming the bad argument.
    """
    check_hist(hist, tokens, shape, batch)
    hbm = _gbps_to_bytes_per_us(profile.hbm_gbps)
    compute = (shape.layer_read_bytes(batch) / hbm + profile.layer_overhead_us
               + profile.policy_call_us(policy, shape.num_experts))
    calls = float(hist.sum())
    return _priced(hist, tokens, shape, profile, batch, calls * compute, shape.shared_bytes / hbm if overlap else None)


def estimate_ranks(hist: np.ndarray, tokens: int, shape: ModelShape, profile: HardwareProfile = H200, *,
                   ranks: int = 1, routed: int | None = None, misses: int | None = None, batch: int = 1,
                   overlap: bool = False, policy: str | None = None) -> DecodeEstimate:
    """Modeled decode time over `ranks` GPUs of one host, expert-parallel (sim.ranks); ranks == 1 is
    estimate_decode exactly (routed and misses unused).

    hist: [L, batch * top_k + 1] calls by the slowest rank's misses (ReplayResult.hist of a ranked replay).
    routed: the busiest rank's distinct experts summed over every call (ReplayResult.layer_routed.sum()).
    misses: every rank's misses (bytes_copied_per_token counts them all: the links run side by side).
    Per layer call, every rank waits for the slowest (the layer ends in an all-reduce):
        the router read (replicated: each rank needs every logit for the top-k)
        + the busiest rank's distinct experts of the call, read at HBM speed
        + (shared expert + non-MoE bytes) / ranks (tensor-parallel)
        + profile.layer_overhead_us + the policy's ensure time over the busiest rank's E / ranks experts
        + ALLREDUCES_PER_LAYER * profile.allreduce_us
        + the slowest rank's miss copy (with overlap, less what its shared-expert share hides).
    The busiest rank's reads and the slowest rank's copy add up even where they are two ranks: an upper
    bound by at most the difference of two ranks' routed reads. estimate_decode charges min(batch * top_k,
    E) routed experts a call, so at batch > 1, where rows share experts, one GPU's figure carries a bound
    this one does not. copy_us_per_token is the slowest rank's copy time. Cost: O(L * Q). Raises ValueError
    naming the bad argument.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, (int, np.integer)) or not 1 <= ranks <= shape.num_experts:
        raise ValueError(f"ranks must be an int in [1, num_experts = {shape.num_experts}], got {ranks!r}")
    if ranks == 1:
        return estimate_decode(hist, tokens, shape, profile, batch=batch, overlap=overlap, policy=policy)
    check_hist(hist, tokens, shape, batch)
    calls = int(hist.sum())
    per_rank = -(-shape.num_experts // ranks)
    for name, v, top in (("routed", routed, calls * min(batch * shape.top_k, per_rank)),
                         ("misses", misses, calls * batch * shape.top_k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= top:
            raise ValueError(f"{name} must be an int in [0, {top}] for {calls} calls over {ranks} ranks, got {v!r}")
    hbm = _gbps_to_bytes_per_us(profile.hbm_gbps)
    split = (shape.shared_bytes + shape.non_moe_bytes_per_layer) / ranks / hbm
    fixed = (shape.router_bytes / hbm + split + profile.layer_overhead_us
             + profile.policy_call_us(policy, per_rank) + ALLREDUCES_PER_LAYER * profile.allreduce_us)
    compute = calls * fixed + int(routed) * shape.expert_bytes / hbm
    shared = shape.shared_bytes / ranks / hbm
    return _priced(hist, tokens, shape, profile, batch, compute, shared if overlap else None, int(misses))


def _priced(hist: np.ndarray, tokens: int, shape: ModelShape, profile: HardwareProfile, batch: int,
            compute: float, shared: float | None, misses: int | None = None) -> DecodeEstimate:
    """The DecodeEstimate of `compute` us over all calls plus each call's copy of hist's miss count (the
    part above `shared` us where the shared expert overlaps it; all of it with shared None). misses: the
    experts copied in all (default: hist's)."""
    miss = np.arange(hist.shape[1])
    copy = np.array([profile.copy_us(shape.expert_bytes, int(m)) for m in miss])
    if shared is not None:
        exposed = np.where(copy > 0, np.maximum(copy, shared) - shared, 0.0)
    else:
        exposed = copy
    counts = hist.astype(np.float64).sum(axis=0)  # [Q + 1] calls by miss count, all layers
    compute_t = compute / tokens
    exposed_t = float(counts @ exposed) / tokens
    us = compute_t + exposed_t
    copied = float(counts @ miss) if misses is None else float(misses)
    return DecodeEstimate(
        us_per_token=us,
        tokens_per_s=batch * 1e6 / us,
        compute_us_per_token=compute_t,
        copy_us_per_token=float(counts @ copy) / tokens,
        exposed_copy_us_per_token=exposed_t,
        bytes_copied_per_token=copied * shape.expert_bytes / tokens,
    )
