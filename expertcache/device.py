"""The slot map and policy state on the device, and the ensure call that drives them.

    DeviceCache(geometry, policy, device)
      state: slot_of int32 [L*E], key_of int32 [S], policy key/slot/glob int64,
             clock int64 [2], counters int64 [L, 3], missed int64 [1] (counters[:, 2].sum(), kept
             by the kernel so a call reads one word, not L), status int32 [1], with rule_mirror mirror
             int64 [2, S] (lt | layer << 56 and lc + dct of each slot's key)   (torch, on device)
      ensure(layer, ids [rows, k] int32 on device[, logit_idx, logit_val [rows, T]])
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

from expertcache.device_ensure import (
    LT_BITS,
    MAX_QUERY,
    MAX_SLOTS,
    MIRROR_MAX_LAYERS,
    SEQ_MAX,
    ST_BAD_ID,
    ST_TOO_MANY,
    ensure_kernel,
)
from expertcache.errors import EnsureError
from expertcache.geometry import NO_KEY, NO_SLOT, CacheGeometry
from expertcache.host import Snapshot
from expertcache.policies import Policy, get_policy
from expertcache.policies.base import KIND_LFUDA, KIND_LRU, KIND_RULE, PolicyState

DEVICE_KINDS = {KIND_LRU: 0, KIND_RULE: 1, KIND_LFUDA: 2}
# Default tiles: slots scored per program (one program up to CHUNK slots, else ceil(S / CHUNK) that
# merge) and warps per program; the fastest at every pool size measured on the H200 (1-2 warps were
# slower: docs/gpu.md). lru, lfuda and rule with its mirror score up to ONE_PROGRAM slots in one program
# (their score is one or two loads per slot): lru at 1650 slots was 0.8-1.3 us faster than 4 programs
# with misses and no slower without, lfuda (8 warps) 0.1-0.7 us, rule with its mirror (8 warps) 0.06-0.8
# us with misses and 0.05-0.14 us slower without; rule through the keys was slower (docs/gpu.md).
CHUNK, NUM_WARPS = 512, 4
ONE_PROGRAM = 2048  # lru, lfuda and rule with its mirror: one program up to this many slots
ONE_PROGRAM_WARPS = {KIND_LRU: 4, KIND_LFUDA: 8, KIND_RULE: 8}  # its warps (8 were faster than 4 at 1650)


def default_tiles(kind: str, num_slots: int, rule_mirror: bool = False) -> tuple[int, int]:
    """(slots per program, warps) when DeviceCache is given no chunk / num_warps."""
    one = kind in ONE_PROGRAM_WARPS and (kind != KIND_RULE or rule_mirror)
    if one and CHUNK < num_slots <= ONE_PROGRAM:
        return triton.next_power_of_2(num_slots), ONE_PROGRAM_WARPS[kind]
    return CHUNK, NUM_WARPS


@dataclass
class EnsureBuffers:
    """Outputs of one ensure shape: slots int32 [rows, k], plan int32 [BLOCK_Q, 2] (the
    first `count` rows are this call's (key, slot) pairs), count int32 [1]."""

    slots: torch.Tensor
    plan: torch.Tensor
    count: torch.Tensor
    block_q: int


class DeviceCache:
    """One slot pool's maps on a device, under one policy (not an oracle)."""

    def __init__(self, geometry: CacheGeometry, policy: Policy | str, device="cuda",
                 chunk: int | None = None, num_warps: int | None = None, seq_max: int = SEQ_MAX,
                 lean: bool = True, early_reads: bool = True, rule_table: bool = True,
                 rule_mirror: bool | None = None, late_ranks: bool | None = None,
                 narrow_score: bool | None = None, **constants) -> None:
        self.geometry = geometry
        self.policy = get_policy(policy, geometry, **constants) if isinstance(policy, str) else policy
        if self.policy.oracle or self.policy.kind not in DEVICE_KINDS:
            raise EnsureError(f"policy {self.policy.name!r} has no device ensure "
                              "(--moe-cache-policy): oracles run in the simulator only")
        if geometry.num_slots >= MAX_SLOTS:
            raise EnsureError(f"{geometry.num_slots} slots (--moe-slots): the device ensure "
                              f"handles fewer than {MAX_SLOTS}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        st = self.policy.init_state()
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=self.device)
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
        if rule_mirror is None:  # the default: on for rule (the only policy that has one) up to its layer count
            rule_mirror = self.policy.kind == KIND_RULE and geometry.num_layers <= MIRROR_MAX_LAYERS
        if not isinstance(rule_mirror, bool):
            raise ValueError(f"rule_mirror must be a bool or None, got {rule_mirror!r}")
        if rule_mirror and self.policy.kind != KIND_RULE:
            raise ValueError(f"rule_mirror is for the rule policy, not {self.policy.name!r}")
        if rule_mirror and geometry.num_layers > MIRROR_MAX_LAYERS:
            raise ValueError(f"rule_mirror packs a layer in {63 - LT_BITS.value} bits: at most "
                             f"{MIRROR_MAX_LAYERS} layers, got {geometry.num_layers}; pass rule_mirror=False")
        # rule_mirror: rule keeps what its score reads of each slot's key also per slot (mirror [2, S]:
        # lt | layer << 56 and lc + dct, kept by the commit beside the per-key rows; a scoring call
        # pins its hits by overwriting their first word), so its scoring reads the filled prefix with
        # two coalesced loads per slot: no key_of, no gathers through the keys, no pinned test per
        # query position; the per-key state stays the host's. On by default for rule: faster on the H200 in
        # every bench_ensure cell with misses (docs/gpu.md); rule_mirror=False scores through the keys
        self.rule_mirror = rule_mirror
        tiles = default_tiles(self.policy.kind, geometry.num_slots, rule_mirror)
        chunk = tiles[0] if chunk is None else chunk
        num_warps = tiles[1] if num_warps is None else num_warps
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {chunk!r}")
        self.chunk = chunk  # slots scored per program; the grid is ceil(S / chunk)
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")
        self.num_warps = num_warps
        if isinstance(seq_max, bool) or not isinstance(seq_max, int) or seq_max < 0:
            raise ValueError(f"seq_max must be an int >= 0, got {seq_max!r}")
        self.seq_max = seq_max  # victims found by successive minima; more take a sort
        if not isinstance(lean, bool):
            raise ValueError(f"lean must be a bool, got {lean!r}")
        # lean (default; False keeps the earlier kernel for comparison): lru scores without key_of
        # and without a pinned test, and a commit without evictions skips the victim gather
        # (device_ensure); faster on the H200 in every lru cell of bench_ensure (docs/gpu.md)
        self.lean = lean
        if not isinstance(early_reads, bool):
            raise ValueError(f"early_reads must be a bool, got {early_reads!r}")
        # early_reads (default): the commit's policy reads (rule's lc / dct, lfuda's hit counts and
        # age) are issued at the start of the launch, beside the query's loads; faster on the H200 in
        # nearly every rule / lfuda cell of bench_ensure (docs/gpu.md). False: read in the commit
        self.early_reads = early_reads
        if not isinstance(rule_table, bool):
            raise ValueError(f"rule_table must be a bool, got {rule_table!r}")
        # rule_table (default): rule's log2(1 + 2**-i/64) growth term loaded from the policy's table
        # (prm[5:], an L2 hit in the commit) instead of computed in float64; the same values (tests).
        # 0.02-0.20 us faster per call on the H200 in 19 of bench_ensure's 20 cells, equal in one
        # (benchmarks/results/ensure-2026-11-30-67de7c5.json). False: computed in the commit
        self.rule_table = rule_table
        if late_ranks is None:  # the default: on for rule
            late_ranks = self.policy.kind == KIND_RULE
        if not isinstance(late_ranks, bool):
            raise ValueError(f"late_ranks must be a bool or None, got {late_ranks!r}")
        # late_ranks: a call that scores reduces its misses' ranks right after the scoring loads are
        # issued, while they are in flight, instead of before them (the same values;
        # device_ensure._chunk_candidates). On by default for rule: 0.03-0.13 us faster in its cells
        # with misses at 512 and 1650 slots in three H200 runs (ensure-2026-12-01-late-*.json,
        # -mirror-first-14bc1d3.json), in 11 of its 16 cells with misses in a fourth
        # (ensure-2026-12-01-e975ced.json; docs/gpu.md); for lru within the spread, so off there
        self.late_ranks = late_ranks
        fits = self.policy.kind == KIND_RULE and self.policy.int32_scores()
        if narrow_score is None:  # the default: on for rule where its constants allow it
            narrow_score = fits
        if not isinstance(narrow_score, bool):
            raise ValueError(f"narrow_score must be a bool or None, got {narrow_score!r}")
        if narrow_score and self.policy.kind != KIND_RULE:
            raise ValueError(f"narrow_score is for the rule policy, not {self.policy.name!r}")
        if narrow_score and not fits:
            c = self.policy.constants
            raise ValueError("narrow_score: rule's scores do not fit in int32 with k_max="
                             f"{c['k_max']}, w={c['w']}, beta={c['beta']}, lc_floor={c['lc_floor']} at "
                             f"{geometry.num_layers} layers; lower them or pass narrow_score=False")
        # narrow_score: rule's score computed in int32 (device_ensure._rule_score), the same values
        # wherever Rule.int32_scores holds, which the defaults do; fewer instructions per scored slot
        self.narrow_score = narrow_score
        self.mirror = t(np.zeros((2, geometry.num_slots) if rule_mirror else 1, np.int64))
        self.grid = triton.cdiv(geometry.num_slots, chunk)
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
        lidx = logit_idx if has_logits else buf.count
        lval = logit_val if has_logits else self.fprm
        block_c = triton.next_power_of_2(self.grid * buf.block_q)
        if block_c not in self._cand:
            self._cand[block_c] = torch.zeros(block_c, dtype=torch.int64, device=self.device)
        g = self.geometry
        ensure_kernel[(self.grid,)](
            ids, lidx, lval, self.slot_of, self.key_of, self.kst, self.sst, self.gst,
            self.prm, self.fprm, self.clock, self.counters, self.missed, buf.slots, buf.plan, buf.count,
            self._cand[block_c], self.arrive, self.status, self.mirror, layer, g.num_experts,
            g.num_layers, g.num_slots, rows * k, k, rows, T,
            POLICY=DEVICE_KINDS[self.policy.kind], HAS_LOGITS=has_logits, CHUNK=self.chunk,
            BLOCK_Q=buf.block_q, BLOCK_R=triton.next_power_of_2(rows * T), BLOCK_C=block_c,
            SINGLE=self.grid == 1,
            SEQ_MAX=self.seq_max, LEAN=self.lean, EARLY=self.early_reads, TABLE=self.rule_table,
            MIRROR=self.rule_mirror, LATE_RANKS=self.late_ranks, NARROW=self.narrow_score,
            num_warps=self.num_warps,
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
               "misses_per_layer_per_token": c[:, 2] / tok}
        if bytes_per_expert is not None:
            out["bytes_copied"] = miss * int(bytes_per_expert)
        return out

    def snapshot(self) -> Snapshot:
        """The state as numpy arrays, comparable with HostCache.snapshot() (syncs)."""
        h = lambda x: x.detach().cpu().numpy().copy()
        glob = h(self.gst)[: len(self.policy.glob_fields)]
        return Snapshot(h(self.slot_of), h(self.key_of), PolicyState(h(self.kst), h(self.sst), glob),
                        h(self.clock), h(self.counters))
