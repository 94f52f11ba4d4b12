"""The slot map and policy state on the device, and the ensure call that drives them.

    DeviceCache(geometry, policy, device, tuning=None)
      launch = resolve_launch(geometry, policy, tuning): EnsureLaunch (rule's mirror and int32
             score where they apply, the tiles), the kernel's fixed choices, made once
      state: slot_of int32 [L*E], key_of int32 [S], policy key/slot/glob int64,
             clock int64 [2], counters int64 [L, 3], missed int64 [1] (counters[:, 2].sum(), kept
             by the kernel so a call reads one word, not L), status int32 [1], for rule with its
             mirror: mirror int64 [2, S] (lt | layer << 56 and lc + dct of each slot's key)
                                                                             (torch, on device)
      ensure(layer, ids [rows, k] int32 on device[, logit_idx, logit_val [rows, T]])
        -> one ensure_kernel launch (expertcache.device.ensure) on the current stream
        -> EnsureBuffers: slots int32 [rows, k], plan int32 [BLOCK_Q, 2], count int32 [1]

Same layout as HostCache, so `snapshot()` compares bit for bit. Output buffers are fixed
per (rows, k, T) and reused, so a captured CUDA graph keeps reading the same memory. The
call does no host sync: a refused call (id out of range, more distinct keys than slots)
only sets `status`; `check()` reads it (a sync) and raises EnsureError. Shapes and
dtypes are checked on the host at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from expertcache.device.ensure import (
    MAX_SLOTS,
    SEQ_MAX,
    ST_BAD_ID,
    ST_TOO_MANY,
    CacheTensors,
    CallTensors,
    ensure_kernel,
)
from expertcache.device.markov import launch_observe
from expertcache.device.policies import (
    MIRROR_MAX_LAYERS,
)
from expertcache.errors import EnsureError
from expertcache.geometry import MAX_QUERY, NO_KEY, NO_SLOT, CacheGeometry
from expertcache.host import Snapshot
from expertcache.policies import REGISTRY, Policy, get_policy
from expertcache.policies.base import PolicyKind, PolicyState
from expertcache.split import MissSplit

# The policies the kernel has a branch for (expertcache.device.policies); the others run on the host only.
DEVICE_POLICIES = frozenset({PolicyKind.LRU, PolicyKind.RULE, PolicyKind.LFUDA, PolicyKind.MARKOV})
# Default tiles, the fastest at every pool size measured (docs/ensure.md): programs of CHUNK slots and
# NUM_WARPS warps, ceil(S / CHUNK) of them that merge; but lru, lfuda and rule with its mirror, whose
# score is one or two loads per slot, score up to ONE_PROGRAM slots in one program of their warps.
CHUNK, NUM_WARPS = 512, 4
ONE_PROGRAM = 2048
ONE_PROGRAM_WARPS = {PolicyKind.LRU: 4, PolicyKind.LFUDA: 8, PolicyKind.RULE: 8}


@dataclass(frozen=True)
class EnsureTuning:
    """The ensure launch's tiles: slots scored per program (chunk, a power of two; the grid is
    ceil(S / chunk)), warps per program, and up to how many victims successive minima over
    registers find (seq_max; more take a sort, and none is compiled when seq_max >= the query's
    block). Any tiles give the same results; DeviceCache picks them by default_tuning."""

    chunk: int = CHUNK
    num_warps: int = NUM_WARPS
    seq_max: int = SEQ_MAX

    def __post_init__(self) -> None:
        c = self.chunk
        if isinstance(c, bool) or not isinstance(c, int) or c < 1 or c & (c - 1):
            raise ValueError(f"EnsureTuning.chunk must be a power of two, got {c!r}")
        if isinstance(self.num_warps, bool) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"EnsureTuning.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if isinstance(self.seq_max, bool) or not isinstance(self.seq_max, int) or self.seq_max < 0:
            raise ValueError(f"EnsureTuning.seq_max must be an int >= 0, got {self.seq_max!r}")


def default_tuning(kind: int, num_slots: int, mirror: bool) -> EnsureTuning:
    """The tiles DeviceCache uses when it is given none (see ONE_PROGRAM)."""
    one = kind in ONE_PROGRAM_WARPS and (kind != PolicyKind.RULE or mirror)
    if one and CHUNK < num_slots <= ONE_PROGRAM:
        return EnsureTuning(triton.next_power_of_2(num_slots), ONE_PROGRAM_WARPS[kind])
    return EnsureTuning(CHUNK, NUM_WARPS)


@dataclass(frozen=True)
class EnsureLaunch:
    """What one DeviceCache launches, resolved once (resolve_launch): the kernel's policy (its POLICY
    constexpr: its PolicyKind, one of DEVICE_POLICIES), whether rule scores from its per-slot mirror
    (mirror) and in int32 (narrow), and the tiles."""

    policy: PolicyKind
    mirror: bool
    narrow: bool
    tuning: EnsureTuning

    def __post_init__(self) -> None:
        if isinstance(self.policy, bool) or self.policy not in DEVICE_POLICIES:
            raise ValueError(f"EnsureLaunch.policy must be one of {sorted(map(int, DEVICE_POLICIES))} (PolicyKind), "
                             f"got {self.policy!r}")
        for name in ("mirror", "narrow"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"EnsureLaunch.{name} must be a bool, got {value!r}")
            if value and self.policy != PolicyKind.RULE:
                raise ValueError(f"EnsureLaunch.{name} is for the rule policy only")
        if not isinstance(self.tuning, EnsureTuning):
            raise ValueError(f"tuning must be an EnsureTuning, got {self.tuning!r}")

    def constexprs(self) -> dict:
        """ensure_kernel's constexprs that stay fixed for the cache."""
        return {"POLICY": int(self.policy), "MIRROR": self.mirror, "NARROW": self.narrow,
                "CHUNK": self.tuning.chunk, "SEQ_MAX": self.tuning.seq_max}


def resolve_launch(geometry: CacheGeometry, policy: Policy, tuning: EnsureTuning | None = None) -> EnsureLaunch:
    """The one place the device ensure's choices are made, from the pool and the policy; none of them
    changes a result, and none is a user option but the tiles.

    mirror: rule keeps what its score reads of each slot's key also per slot (two coalesced words per
      slot instead of gathers through key_of), faster in every measured cell with misses; its first
      word packs the layer in 63 - LT_BITS bits, so only up to MIRROR_MAX_LAYERS layers. Past that rule
      scores through key_of and the per-key rows, as lfuda does.
    narrow: rule's score in int32, fewer instructions per scored slot, wherever Rule.int32_scores holds
      for its constants (the defaults at any layer count); else in int64.
    tuning: the tiles, default_tuning's unless given.
    Hard-wired per policy in the kernel: rule reduces its miss ranks behind its scoring loads, lru and
    lfuda before them (policies._late_ranks)."""
    rule = policy.kind == PolicyKind.RULE
    mirror = rule and geometry.num_layers <= MIRROR_MAX_LAYERS
    narrow = rule and policy.int32_scores()
    if tuning is None:
        tuning = default_tuning(policy.kind, geometry.num_slots, mirror)
    return EnsureLaunch(policy.kind, mirror, narrow, tuning)


@dataclass
class EnsureBuffers:
    """Outputs of one ensure shape: slots int32 [rows, k], plan int32 [BLOCK_Q, 2] (the
    first `count` rows are this call's (key, slot) pairs), count int32 [1]."""

    slots: torch.Tensor
    plan: torch.Tensor
    count: torch.Tensor
    block_q: int


def device_policy_names() -> list[str]:
    """The registered policies that have a device ensure (a kind in DEVICE_POLICIES), sorted."""
    return sorted(n for n, info in REGISTRY.items() if getattr(info.factory, "kind", None) in DEVICE_POLICIES)


class DeviceCache:
    """One slot pool's maps on a device, under one policy (not an oracle).

    tuning: the launch's tiles (EnsureTuning); None: default_tuning's. constants: the policy's
    (get_policy), when `policy` is a name. split: the miss split (expertcache.split.MissSplit; None:
    every miss copied), exactly as HostCache applies it: the served misses' slots are CPU_SLOT and
    `served` [L] counts them.
    """

    def __init__(self, geometry: CacheGeometry, policy: Policy | str, device="cuda",
                 tuning: EnsureTuning | None = None, split: MissSplit | None = None, **constants) -> None:
        self.geometry = geometry
        self.policy = get_policy(policy, geometry, **constants) if isinstance(policy, str) else policy
        if self.policy.oracle or self.policy.kind not in DEVICE_POLICIES:
            raise EnsureError(f"policy {self.policy.name!r} has no device ensure (--moe-cache-policy): "
                              f"on a GPU choose one of {', '.join(device_policy_names())}; it runs in "
                              "the simulator and the CPU engine")
        if geometry.num_slots >= MAX_SLOTS:
            raise EnsureError(f"{geometry.num_slots} slots (--moe-slots): the device ensure "
                              f"handles fewer than {MAX_SLOTS}")
        if split is not None and not isinstance(split, MissSplit):
            raise EnsureError(f"split must be a MissSplit or None, got {type(split).__name__}")
        self.split = MissSplit.copy() if split is None else split
        self.launch = resolve_launch(geometry, self.policy, tuning)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        st = self.policy.init_state()
        def t(a):
            return torch.as_tensor(np.ascontiguousarray(a), device=self.device)
        self.slot_of = t(np.full(geometry.num_keys, NO_SLOT, np.int32))
        self.key_of = t(np.full(geometry.num_slots, NO_KEY, np.int32))
        self.kst, self.sst = t(st.key), t(st.slot)
        self.gst = t(st.glob if st.glob.size else np.zeros(1, np.int64))
        self.prm, self.fprm = t(self.policy.params()), t(self.policy.fparams())
        self.clock = t(np.zeros(2, np.int64))
        self.counters = t(np.zeros((geometry.num_layers, 3), np.int64))
        self.missed = t(np.zeros(1, np.int64))  # counters[:, 2].sum(): the filled prefix is min(it, S)
        self.status = t(np.zeros(1, np.int32))
        self.arrive = t(np.zeros(1, np.int32))
        self._split_on = not self.split.copies_all
        self.split_table = t(self.split.copies.copy() if self._split_on else np.zeros(1, np.int32))
        self.served = t(np.zeros(geometry.num_layers if self._split_on else 1, np.int64))
        # rule's per-slot mirror (resolve_launch): lt | layer << LT_BITS and lc + dct of each slot's key
        self.mirror = t(np.zeros((2, geometry.num_slots) if self.launch.mirror else 1, np.int64))
        self.grid = triton.cdiv(geometry.num_slots, self.launch.tuning.chunk)
        self._tensors = CacheTensors(self.slot_of, self.key_of, self.kst, self.sst, self.gst, self.mirror,
                                     self.prm, self.fprm, self.clock, self.counters, self.missed,
                                     self.status, self.arrive, self.split_table, self.served)
        self._constexprs = self.launch.constexprs()
        self._markov = markov = self.policy.kind == PolicyKind.MARKOV
        self._markov_params = tuple(int(p) for p in self.policy.params()) if markov else ()
        # markov's call's distinct experts, between its two learning launches
        self._markov_scratch = (torch.empty(geometry.num_experts, dtype=torch.int64, device=self.device)
                                if markov else None)
        self._buffers: dict[tuple[int, int], EnsureBuffers] = {}
        self._cand: dict[int, torch.Tensor] = {}

    def buffers(self, rows: int, k: int) -> EnsureBuffers:
        """The fixed output buffers of calls with ids [rows, k]."""
        if (rows, k) not in self._buffers:
            bq = triton.next_power_of_2(rows * k)
            self._buffers[(rows, k)] = EnsureBuffers(
                torch.full((rows, k), NO_SLOT, dtype=torch.int32, device=self.device),
                torch.zeros((bq, 2), dtype=torch.int32, device=self.device),
                torch.zeros(1, dtype=torch.int32, device=self.device), bq)
        return self._buffers[(rows, k)]

    def _check_args(self, layer, ids, logit_idx, logit_val) -> None:
        L = self.geometry.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
            raise EnsureError(f"layer must be an int in [0, {L}), got {layer!r}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.dim() != 2:
            raise EnsureError("ids must be an int32 tensor [rows, k]")
        if ids.device != self.device or not ids.is_contiguous():
            raise EnsureError(f"ids must be contiguous on {self.device}")
        if ids.numel() >= MAX_QUERY:
            raise EnsureError(f"ids [rows, k] has {ids.numel()} entries: one call takes fewer "
                              f"than {MAX_QUERY} (decode batch rows * top_k)")
        if (logit_idx is None) != (logit_val is None):
            raise EnsureError("logit_idx and logit_val come together: pass both or neither")
        if logit_idx is not None:
            if (logit_idx.dtype != torch.int32 or logit_val.dtype != torch.float32
                    or logit_idx.shape != logit_val.shape or logit_idx.dim() != 2
                    or logit_idx.shape[0] != ids.shape[0]):
                raise EnsureError(f"logit_idx int32 / logit_val float32 must both be "
                                  f"[{ids.shape[0]}, T] on {self.device}")

    def ensure(self, layer: int, ids: torch.Tensor, logit_idx: torch.Tensor | None = None,
               logit_val: torch.Tensor | None = None, pdl: bool = False) -> EnsureBuffers:
        """Launch one ensure on the current stream (no sync; capturable). See the module.
        pdl: on CUDA, a programmatic dependent launch (waits for its predecessor before reading;
        the same results)."""
        self._check_args(layer, ids, logit_idx, logit_val)
        rows, k = ids.shape
        buf = self.buffers(rows, k)
        has_logits = logit_idx is not None and self.policy.uses_logits
        T = logit_idx.shape[1] if has_logits else 1
        block_c = triton.next_power_of_2(self.grid * buf.block_q)
        if block_c not in self._cand:
            self._cand[block_c] = torch.zeros(block_c, dtype=torch.int64, device=self.device)
        io = CallTensors(ids, logit_idx if has_logits else buf.count, logit_val if has_logits else self.fprm,
                         buf.slots, buf.plan, buf.count, self._cand[block_c])
        g = self.geometry
        if self._markov:  # the call's routing enters the state before victims are chosen
            launch_observe(self.kst, self.gst, self._markov_params, layer, ids, self.slot_of, g.num_experts,
                           g.num_slots, self._markov_scratch)
        ensure_kernel[(self.grid,)](
            self._tensors, io, layer, g.num_experts, g.num_layers, g.num_slots, rows * k, k, rows, T,
            HAS_LOGITS=has_logits, BLOCK_Q=buf.block_q, BLOCK_R=triton.next_power_of_2(rows * T),
            BLOCK_C=block_c, SINGLE=self.grid == 1, **self._constexprs, num_warps=self.launch.tuning.num_warps,
            **({"SPLIT": True, "FILL": self.split.fills} if self._split_on else {}),
            **({"GDC": True, "launch_pdl": True} if pdl and self.device.type == "cuda" else {}))
        return buf

    def check(self) -> None:
        """Raise EnsureError if a call was refused since the last check (syncs)."""
        code = int(self.status.item())
        if code:
            self.status.zero_()
            why = {ST_BAD_ID: f"an expert id outside [0, {self.geometry.num_experts}) "
                              "(num_experts); use -1 for padding",
                   ST_TOO_MANY: "more distinct experts in one call than slots (--moe-slots)"}
            raise EnsureError("a device ensure call was refused and changed nothing: "
                              + why.get(code, f"code {code}"))

    def stats(self, bytes_per_expert: int | None = None) -> dict:
        """Counters so far, read from the device (one sync: call it off the hot path).

        Returns calls, accesses and misses per layer (int64 [L] each), their totals, the
        hit rate, misses per decode step (`clock[1]` steps), and with `bytes_per_expert`
        (HostStore.bytes_per_expert) the bytes copied in.
        """
        c = self.counters.cpu().numpy()
        tok = max(int(self.clock[1].item()), 1)
        acc, miss = int(c[:, 1].sum()), int(c[:, 2].sum())
        out = {"calls": c[:, 0].copy(), "accesses": c[:, 1].copy(), "misses": c[:, 2].copy(),
               "total_accesses": acc, "total_misses": miss,
               "hit_rate": 1.0 - miss / acc if acc else 0.0,
               "misses_per_layer_per_token": c[:, 2] / tok,
               "served": int(self.served.sum().item()) if self._split_on else 0}
        if bytes_per_expert is not None:
            out["bytes_copied"] = (miss - out["served"]) * int(bytes_per_expert)
        return out

    def snapshot(self) -> Snapshot:
        """The state as numpy arrays, comparable with HostCache.snapshot() (syncs)."""
        def h(x):
            return x.detach().cpu().numpy().copy()
        glob = h(self.gst)[: len(self.policy.glob_fields)]
        return Snapshot(h(self.slot_of), h(self.key_of), PolicyState(h(self.kst), h(self.sst), glob),
                        h(self.clock), h(self.counters),
                        h(self.served) if self._split_on else np.zeros(self.geometry.num_layers, np.int64))
