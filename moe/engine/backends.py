"""MoE block backends of the engine: decode through the expert cache, prefill around it.

    decode, hidden [B, H] of MoE layer m:
      CpuCachedMoE: route (f32) → HostCache.ensure(m, ids) → reference_copy(plan: store rows → CPU SlotPool)
                    → routed_reference(hidden, slots, weights, pool) (f32) + shared_expert (f32) → cast
      GpuMoE:       moe.engine.layer.MoELayer.forward over one moe.engine.layer.SlotCache (device ensure, miss copy,
                    routed GEMM by slot id), each layer launching from its resolved LaunchPlan (the
                    shared expert and early hits on the side stream where copy_overlap is on and applies);
                    no host sync, so the engine captures whole decode steps (moe.engine.graphs); with
                    forced_routing the ids / weights come from static buffers (set_routing), not the router
    prefill, hidden [T, H] (any T): moe_prefill for both — the cache is bypassed (below).

Legend: B = decode rows, T = prompt tokens, H = hidden, E = experts, k = top_k, S = slots, m = MoE layer.

Why prefill bypasses the cache: a prompt of a few hundred tokens routes to nearly every expert of
every layer, so pushing it through ensure would evict the whole decode working set (the sequences
already decoding would then miss on every expert of their next step), and one call may need more
distinct experts than there are slots (ensure refuses that). Chunking the prompt to S // k tokens
would work but still flush the pool. Instead prefill reads each used expert's rows straight from the
HostStore once per layer (on a GPU: copy-engine transfers from pinned memory into a ring of PREFILL_STAGING staging
slots, on their own stream, running ahead of the compute) and leaves the slot map, policy state, clocks and counters
untouched; an expert that already has a slot is computed from the pool instead (read only, no transfer: the slot holds
the same bytes). Both backends share this one function; the decode math is the same formula.

Measured on the real traces with the host reference (benchmarks/bench_prefill_admission.py; the
figures are in docs/): pushing the prompt through the cache instead barely changes the misses of the
decode steps that follow (the decode working set turns over within a few steps anyway), while its
own copies are several times the experts streamed here (a small pool evicts prompt experts between
chunks); reading resident experts from their slots cuts what is streamed by a large factor.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from expertcache.copy import reference_copy, reference_tail_copy
from expertcache.geometry import CPU_SLOT, CacheGeometry
from expertcache.host import HostCache
from expertcache.pool import HostStore, SlotPool
from expertcache.split import MissSplit, split_for_slots
from moe.engine.budget import PREFILL_STAGING, check_slots
from moe.engine.expert_parallel import ExpertShard
from moe.engine.layer import MoELayer, SlotCache
from moe.kernels.cpu_experts import MAX_TOKENS as CPU_MAX_TOKENS
from moe.kernels.cpu_experts import CpuExperts
from moe.kernels.decode_rows import dequantize_rows_fast
from moe.kernels.routed import routed_reference
from moe.model.checkpoint import EXPERT_BIAS_BANKS, ModelWeights, MoEWeights
from moe.model.config import MoEConfig
from moe.model.reference import gated_activation, route_block, shared_expert
from moe.model.slot_matrix import SlotMatrix


class MoEBackend(Protocol):
    """What the engine asks of an MoE backend."""

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [B, H] -> (out [B, H] hidden's dtype, routed ids [B, k] int32 when `record` else None)."""

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> out [T, H]; leaves the cache untouched."""

    def check(self) -> None:
        """Raise what went wrong off the decode's stream since the last step (a CPU worker's failure)."""

    @property
    def extra_slots(self) -> int:
        """Expert slots held beyond the cache's (a hybrid split's scratch slot), for the memory line."""


def expert_matrices(banks, cfg: MoEConfig) -> tuple[SlotMatrix, SlotMatrix]:
    """(gate_up [N, 2I, H] of 2 stacked matrices, down [N, H, I]) of a HostStore or SlotPool in the
    config's expert format (N = its keys or slots). No device work."""
    h, i = cfg.hidden, cfg.expert_intermediate
    return (SlotMatrix.of_pool(banks, cfg.format, "gate_up", 2 * i, h, 2),
            SlotMatrix.of_pool(banks, cfg.format, "down", h, i))


def expert_biases(banks, cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """routed_reference's gate_up_bias [N, 2I] / down_bias [N, H] keywords: the bias banks of a HostStore
    or SlotPool whose block has expert biases (gpt-oss), else none."""
    if not cfg.expert_bias:
        return {}
    return {name: banks.tensor(name) for name in EXPERT_BIAS_BANKS}


PREFETCH_MIN_USES = 4  # T * k / E at which a prompt is expected to use nearly every expert (1 - e^-4 = 98 %)
PREFILL_GROUP = 8  # used experts prefill computes in one batched GEMM (fewer host ops per expert)
GROUP_BYTES = 256 << 20  # at most this many bytes of float32 expert weights a group (fewer experts when large)
PAIR_BYTES = 128 << 20  # a layer's float32 [T * k, H] pair outputs kept whole up to this size (moe_prefill_routed)


def expert_f32_bytes(cfg: MoEConfig) -> int:
    """Bytes of one expert's float32 weights (gate_up [2I, H] and down [H, I]) as prefill computes them."""
    return 3 * cfg.expert_intermediate * cfg.hidden * 4


def prefill_groups(used: list[int], per: list[int], size: int) -> list[tuple[int, list[int]]]:
    """The used experts (increasing ids) in consecutive groups of at most `size`, as (the first one's
    index in `used`, the group): a group's token rows are padded to its largest count, so an expert
    joins only while the padded rows stay within twice the real ones (a hot expert goes alone)."""
    groups: list[tuple[int, list[int]]] = []
    for u, expert in enumerate(used):
        n = per[expert]
        if groups:
            _, g = groups[-1]
            rows = sum(per[e] for e in g) + n
            if len(g) < size and (len(g) + 1) * max(n, max(per[e] for e in g)) <= 2 * rows:
                g.append(expert)
                continue
        groups.append((u, [expert]))
    return groups


def out_group(out: torch.Tensor, hidden: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor, counts: list[int],
              lo: int, u0: int, rows_all: torch.Tensor, weight_all: torch.Tensor, rank: torch.Tensor,
              used_at: torch.Tensor, cfg: MoEConfig | None = None,
              biases: tuple[torch.Tensor, torch.Tensor] | None = None, pair_rows: torch.Tensor | None = None) -> None:
    """Add a group of G consecutive used experts' gated outputs to out [T, H] (float32): their tokens
    (sorted pairs lo .. lo + sum(counts), each expert's a run) padded to [G, max count, H], two batched
    float32 GEMMs (moe_reference's expert_mlp per expert: silu(gate) * up, then down), the padding
    dropped, each expert's rows times their gate weights added with one index_add_ per expert (a token
    appears once per expert, so the sum is deterministic: the experts in increasing id order). cfg: the
    activation (gated_activation); biases: the group's (gate_up [G, 2I], down [G, H]) float32 (gpt-oss).
    With pair_rows (int64 [T * k], each sorted pair's row of the layer's pair buffer), `out` is that buffer
    [T * k, H] and the group's weighted rows are written to their rows in one index_copy_ (each row once), to
    be summed by the caller; without, they are added to out [T, H] expert by expert."""
    g, n = len(counts), sum(counts)
    width = max(counts)
    x = hidden.index_select(0, rows_all.narrow(0, lo, n)).float()  # [n, H]
    if g == 1:
        padded, at = x.unsqueeze(0), None
    else:  # pair i of expert u goes to row (u - u0) * width + its rank
        at = (used_at.narrow(0, lo, n) - u0) * width + rank.narrow(0, lo, n)
        padded = x.new_zeros(g * width, x.shape[1]).index_copy_(0, at, x).view(g, width, -1)
    gate_up = torch.bmm(padded, w_gu.transpose(1, 2))  # [G, width, 2I]
    if biases is not None:
        gate_up = gate_up + biases[0][:, None, :]
    y = torch.bmm(gated_activation(gate_up, cfg), w_dn.transpose(1, 2))  # [G, width, H]
    if biases is not None:
        y = y + biases[1][:, None, :]
    y = y.view(g * width, -1)  # [G * width, H]
    y = (y if at is None else y.index_select(0, at)) * weight_all.narrow(0, lo, n)  # [n, H], pair order
    if pair_rows is not None:
        out.index_copy_(0, pair_rows.narrow(0, lo, n), y)
        return
    start = 0
    for c in counts:
        out.index_add_(0, rows_all.narrow(0, lo + start, c), y.narrow(0, start, c))
        start += c


class PrefillStaging:
    """A ring of `num_slots` device slots (a SlotPool over the store's banks) and a copy stream through
    which prefill moves the experts it needs that have no cache slot, ahead of the compute.

    Copies are issued in the order the experts will be computed; copy n goes to ring slot n % R once
    the compute that read copy n - R is queued (an event), so up to R copies run ahead on the copy
    engine. `layer(keys)` serves one layer's keys in order; `prefetch(keys)` starts the next layer's
    likely keys (a long prompt's: every expert without a slot) before that layer's attention and router
    have run, so the copies continue across layers; a later `layer` uses the prefetched copies its keys
    include, in order, and drops the rest. Bytes: num_slots * the bytes of one expert, allocated once.
    Raises PoolError where the ring does not fit."""

    def __init__(self, store: HostStore, num_slots: int, device: torch.device) -> None:
        self.store = store
        self.pool = SlotPool(store.banks, num_slots, device=device)
        self.stream = torch.cuda.Stream(device=self.pool.device)
        self.ring = num_slots
        # on a GPU each bank's copy is one cudaMemcpyAsync between raw addresses (cuda-python, the 'gpu'
        # extra; without it torch's copy_): a torch copy_ of two row views costs the host several times more,
        # and a long prompt's layer copies hundreds of rows
        self._raw = _RawRowCopy.where_possible(store, self.pool, self.stream)
        self.issued = 0  # copies issued so far: copy n is in ring slot n % ring
        self.freed: dict[int, torch.cuda.Event] = {}  # copy n -> its slot's last read is queued
        self.pending: list[tuple[int, int, torch.cuda.Event]] = []  # prefetched (key, copy n, copied)
        self.wanted: list[int] = []  # keys to copy next, in order, as ring slots free
        self.prefetched_unused = 0  # prefetched copies no layer used (counted for the docs' measurements)

    def _issue(self) -> None:
        """Copy wanted keys while their ring slot's previous read is queued."""
        while self.wanted and (self.issued < self.ring or self.issued - self.ring in self.freed):
            key, n = self.wanted.pop(0), self.issued
            if n >= self.ring:
                self.stream.wait_event(self.freed.pop(n - self.ring))
            if self._raw is not None:
                self._raw.copy(key, n % self.ring)
            else:
                with torch.cuda.stream(self.stream):
                    for bank in self.store.banks:
                        self.pool.tensor(bank.name)[n % self.ring].copy_(self.store.tensor(bank.name)[key],
                                                                         non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            self.pending.append((key, n, done))
            self.issued += 1

    def _free(self, ns: list[int]) -> None:
        """Copies `ns`' slots are free once the current stream's work queued so far has run: one event."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        for n in ns:
            self.freed[n] = event

    def prefetch(self, keys: list[int]) -> None:
        """Start copying `keys` (increasing) for the next layer, before its routing is known."""
        self.wanted = list(keys)
        self._issue()

    def layer(self, keys: list[int]) -> _StagedLayer:
        """Serve `keys` (increasing store keys, the compute's order): the prefetched copies of a prefix of
        them are used, every other prefetched copy is dropped, the rest are copied as the ring frees."""
        used, p, pending = [], 0, self.pending
        for key in keys:
            while p < len(pending) and pending[p][0] < key:  # prefetched, not needed
                self._drop(pending[p])
                p += 1
            if p < len(pending) and pending[p][0] == key:
                used.append(pending[p])
                p += 1
            else:  # not prefetched: it and every later key are copied afresh, in order
                break
        for entry in pending[p:]:
            self._drop(entry)
        self.pending, self.wanted = [], list(keys[len(used):])
        return _StagedLayer(self, used)

    def _drop(self, entry: tuple[int, int, torch.cuda.Event]) -> None:
        """A prefetched copy no layer reads: its slot is free (a later copy into it follows this one on
        the copy stream)."""
        self.prefetched_unused += 1
        self._free([entry[1]])


class _RawRowCopy:
    """One key's rows of every bank of a pinned HostStore into one slot of a device SlotPool, on `stream`:
    a cudaMemcpyAsync a bank between the rows' addresses (cuda-python), what torch's copy_ of the two row
    views queues, without its dispatch. Raises RuntimeError naming the failed call."""

    def __init__(self, store: HostStore, pool: SlotPool, stream: torch.cuda.Stream, cudart) -> None:
        self.cudart = cudart
        self.kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.stream = stream
        self.keys, self.slots = store.num_keys, pool.num_slots
        self.banks = []  # (host base, device base, row bytes)
        for bank in store.banks:
            src, dst = store.tensor(bank.name), pool.tensor(bank.name)
            if not (src.is_contiguous() and dst.is_contiguous()):
                raise RuntimeError(f"bank {bank.name!r}: the staging copy needs contiguous rows")
            self.banks.append((src.data_ptr(), dst.data_ptr(), bank.row_bytes))

    @classmethod
    def where_possible(cls, store: HostStore, pool: SlotPool, stream: torch.cuda.Stream) -> _RawRowCopy | None:
        """The raw copy for a CUDA pool where cuda-python is installed, else None (torch's copy_)."""
        if pool.device.type != "cuda":
            return None
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            return None
        return cls(store, pool, stream, cudart)

    def copy(self, key: int, slot: int) -> None:
        if not (0 <= key < self.keys and 0 <= slot < self.slots):  # raw addresses have no bounds check
            raise IndexError(f"prefill staging: key {key} of {self.keys} or slot {slot} of {self.slots} out of range")
        handle = self.stream.cuda_stream
        for src, dst, row in self.banks:
            (err,) = self.cudart.cudaMemcpyAsync(dst + slot * row, src + key * row, row, self.kind, handle)
            if err != self.cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"prefill staging: cudaMemcpyAsync of key {key} failed with "
                                   f"{getattr(err, 'name', err)}")


class _StagedLayer:
    """One layer's keys through a PrefillStaging ring: slot(j) returns the j-th key's ring slot (its copy
    issued, perhaps not done); wait(j) makes the current stream wait for copies 0..j at once
    (the copies run in order on one stream, so the j-th one's event covers every earlier one);
    release(js) records that the current stream's reads of those copies are queued, which lets the ring
    copy further keys into their slots; ready(j) says whether the j-th copy is issued (copies take the
    ring's slots in order, so it may wait for the release of any one before it)."""

    def __init__(self, staging: PrefillStaging, used: list[tuple[int, int, torch.cuda.Event]]) -> None:
        self.staging = staging
        self.copies = [(n, done) for _, n, done in used]
        staging._issue()

    def ready(self, j: int) -> bool:
        """Whether the j-th key's copy is issued (else it waits for a release of a copy before it)."""
        return len(self.copies) + len(self.staging.pending) > j

    def slot(self, j: int) -> int:
        st = self.staging
        while len(self.copies) <= j:  # the key's copy is issued in order, as the ring frees slots
            key, n, done = st.pending.pop(0)
            self.copies.append((n, done))
        return self.copies[j][0] % st.ring

    def wait(self, j: int) -> None:
        torch.cuda.current_stream().wait_event(self.copies[j][1])

    def release(self, js: list[int]) -> None:
        self.staging._free([self.copies[j][0] for j in js])
        self.staging._issue()


def moe_prefill(store: HostStore, cfg: MoEConfig, w: MoEWeights, hidden: torch.Tensor,
                resident: tuple[torch.Tensor, SlotPool] | None = None,
                counts: list[int] | None = None, staging: PrefillStaging | None = None) -> torch.Tensor:
    """One MoE block over a prompt, experts read from `store` (cache bypassed): [T, H] -> [T, H]: the
    routed sum of moe_prefill_routed plus the shared expert, cast once to hidden's dtype."""
    out = moe_prefill_routed(store, cfg, w, hidden, resident, counts, staging)
    if w.shared is not None:
        out += shared_expert(hidden, w.shared)
    return out.to(hidden.dtype)


def moe_prefill_routed(store: HostStore, cfg: MoEConfig, w: MoEWeights, hidden: torch.Tensor,
                       resident: tuple[torch.Tensor, SlotPool] | None = None,
                       counts: list[int] | None = None, staging: PrefillStaging | None = None,
                       shard: ExpertShard | None = None) -> torch.Tensor:
    """The routed experts of one MoE block over a prompt, experts read from `store` (cache bypassed):
    [T, H] -> float32 [T, H], no shared expert, no cast. With `shard` (moe.engine.expert_parallel), only the
    experts its rank owns, by local id, `store` and `resident` holding that rank's keys.

    Math and precision of moe.model.reference.moe_reference: float32 products (moe_prefill casts once); each expert's
    weights are its format's float32 decode (expertcache.formats). The used experts are computed in increasing id
    order, in groups of up to PREFILL_GROUP, each group's weights decoded at once (dequantize_rows_fast: on a GPU
    one Triton launch a matrix, reading each slot where it is) and multiplied in batched float32 GEMMs over their
    tokens padded to the group's largest count (out_group: a prompt's MoE layer is bound by the host's ops per
    expert, not the GPU, until experts are batched); each token's expert outputs are added in increasing expert
    id order into a float32 sum (up to PAIR_BYTES through a [T * k, H] pair buffer, one write a group and k adds
    a layer, without a shard; otherwise one index_add_ an expert: the same additions in the same
    order). An expert with a
    slot in `resident` = (slot_of [L_moe * E] int32, the SlotPool) is read from the pool (the same bytes, so the same
    result bit for bit) and nothing moves; the others are streamed: through `staging` (a GPU's PrefillStaging: copies
    on its stream, up to its ring size ahead of the compute; where T * k >= PREFETCH_MIN_USES * E the next MoE layer's
    experts without a slot are prefetched into it at the end) or, without one, moved to hidden's device as each is
    computed. Nothing of the cache is written. counts: optional [streamed, reused], incremented. Cost O(T * k * 3 * I
    * H + T * E * H) compute, (used experts without a slot) * the expert's bytes moved (and the prefetched experts the
    next layer does not use); one host sync (the layer's per-expert token counts and its E slot ids, and the next
    layer's when prefetching).
    """
    weights, ids = route_block(hidden, w.router, cfg, w.router_bias, w.score_bias)  # [T, k] f32, i32
    e_count = cfg.num_experts if shard is None else shard.experts
    if shard is not None:  # local ids; the other ranks' experts -> e_count, a bucket nobody computes
        ids = shard.local_ids(ids, e_count)
    k = ids.shape[1]
    gate_up, down = expert_matrices(store, cfg)
    pool = None if resident is None else expert_matrices(resident[1], cfg)
    base = w.index * e_count
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs by expert, tokens ascending
    per_dev = torch.bincount(flat, minlength=e_count + 1)  # [e_count + 1]: the last bucket sorts after every expert
    per = per_dev[:e_count]
    # a long prompt uses nearly every expert: the next MoE layer's experts without a slot are copied
    # ahead, from the end of this layer's compute through the next layer's attention and router
    ahead = (staging is not None and resident is not None and ids.numel() >= PREFETCH_MIN_USES * e_count
             and base + 2 * e_count <= resident[0].numel())
    if resident is not None:  # the one host read: token counts and slot ids (this layer's, the next's) together
        slots = resident[0][base:base + (2 if ahead else 1) * e_count].to(per.device, torch.int64)
        both = torch.cat([per, slots]).tolist()
        per, slot_of, next_slot_of = both[:e_count], both[e_count:2 * e_count], both[2 * e_count:]
    else:
        per, slot_of, next_slot_of = per.tolist(), [-1] * e_count, []
    used = [e for e in range(e_count) if per[e]]
    streamed = [e for e in used if slot_of[e] < 0]
    staged = staging.layer([base + e for e in streamed]) if staging is not None else None
    if staged is not None:
        st_gate_up, st_down = expert_matrices(staging.pool, cfg)
    starts = [0]
    for n in per:
        starts.append(starts[-1] + n)
    # per layer, on the device: the sorted pairs' tokens, gate weights, rank within their expert and their
    # expert's place among the used ones; a group of experts is then one contiguous slice of each
    flat_sorted = flat[order]
    rows_all, weight_all = order // k, weights.reshape(-1)[order].unsqueeze(1)
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(per_dev, 0) - per_dev)[flat_sorted]
    used_at = (torch.cumsum(per_dev > 0, 0) - 1)[flat_sorted]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    # up to PAIR_BYTES, each pair's weighted output goes to row t * k + (its expert's place among token t's
    # experts, increasing ids) of a pair buffer, one write a group, and the k columns are added in order at
    # the end: the same additions per token, in the same order, as adding each expert's rows in turn
    pairs = None
    if shard is None and ids.numel() * hidden.shape[1] * 4 <= PAIR_BYTES:  # a rank computes a few of the pairs
        by_id = torch.argsort(ids, dim=1, stable=True)  # [T, k]: the token's choices in increasing expert id
        place = torch.empty_like(by_id).scatter_(1, by_id, torch.arange(k, device=ids.device).expand_as(by_id))
        slot_rows = torch.arange(ids.shape[0], device=ids.device)[:, None] * k + place  # [T, k]
        pair_rows = slot_rows.reshape(-1)[order]
        pairs = torch.zeros((ids.numel(), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    size = max(1, min(PREFILL_GROUP, GROUP_BYTES // expert_f32_bytes(cfg)))
    layer_biases = None  # gpt-oss: the layer's expert biases, float32 [E, 2I] and [E, H], the store's values
    if cfg.expert_bias:
        layer_biases = tuple(store.tensor(name)[base:base + e_count].to(hidden.device, torch.float32)
                             for name in EXPERT_BIAS_BANKS)
    j = 0  # the next streamed expert
    rows: list = []  # the experts decoded next: their (gate_up, slot) and (down, slot), and the ring copies held
    held: list[int] = []

    def decode() -> tuple[torch.Tensor, torch.Tensor]:
        """rows decoded at once into new tensors (float32 [G, 2I, H], [G, H, I]); their ring slots then free
        (also when the decode fails, so the ring serves later prompts)."""
        try:
            if held:  # the ring copies of the rows, waited for at once: the last one's event covers them all
                staged.wait(held[-1])
            return tuple(dequantize_rows_fast([r[i] for r in rows], hidden.device) for i in (0, 1))
        finally:
            if held:
                staged.release(held)
            rows.clear()
            held.clear()

    for u0, group in prefill_groups(used, per, size):
        done = []  # a group whose streamed experts the ring cannot hold at once is decoded in parts
        for expert in group:
            slot = slot_of[expert]
            if slot >= 0:
                rows.append(((pool[0], slot), (pool[1], slot)))
            elif staged is not None:
                if not staged.ready(j):  # its copy waits for a ring slot the rows hold
                    done.append(decode())
                r = staged.slot(j)  # decode() waits for the group's copies
                rows.append(((st_gate_up, r), (st_down, r)))
                held.append(j)
            else:
                rows.append(((gate_up, base + expert), (down, base + expert)))
            if counts is not None:
                counts[int(slot >= 0)] += 1
            if slot < 0:
                j += 1
        done.append(decode())
        w_gu, w_dn = done[0] if len(done) == 1 else (torch.cat([d[i] for d in done]) for i in (0, 1))
        picked = None if layer_biases is None else tuple(b[group] for b in layer_biases)
        out_group(out if pairs is None else pairs, hidden, w_gu, w_dn, [per[e] for e in group], starts[group[0]],
                  u0, rows_all, weight_all, rank, used_at, cfg, picked, None if pairs is None else pair_rows)
    if pairs is not None:
        for c in pairs.view(ids.shape[0], k, hidden.shape[1]).unbind(1):
            out += c
    if ahead:
        staging.prefetch([base + e_count + e for e in range(e_count) if next_slot_of[e] < 0])
    return out


def _geometry(weights: ModelWeights, num_slots: int, max_batch: int, experts: int | None = None) -> CacheGeometry:
    """The cache geometry over `experts` a layer (default the model's), refusing a pool too small for
    `max_batch` rows of top_k experts or larger than every routed expert it caches."""
    spec = weights.spec
    experts = spec.moe.num_experts if experts is None else experts
    check_slots(num_slots, spec.num_moe_layers, experts, min(spec.moe.top_k, experts), max_batch)
    return CacheGeometry(spec.num_moe_layers, experts, num_slots)


class CpuCachedMoE:
    """The CPU backend: the exact host reference of the cache (HostCache) over a CPU SlotPool.

    Same slot map, policy, plan and counters as the GPU path would produce for the same routing;
    the miss copy is expertcache.copy.reference_copy and the routed compute moe.kernels.routed.routed_reference
    (float32), so a run exercises the cache's semantics end to end without a GPU. With a miss split
    (expertcache.split.MissSplit: `split`), the misses it serves on the CPU are computed from the
    HostStore in place by moe.kernels.cpu_experts (float32) and added after the slots' experts; a hybrid
    split whose slots hold every routed expert runs as copy (expertcache.split.split_for_slots).
    `cache` (HostCache) is public: its counters [L_moe, 3] give calls, accesses, misses per MoE layer,
    its `served` [L_moe] the misses computed from the store.
    With `shard` (moe.engine.expert_parallel), one rank's share of expert parallelism: `weights.store`
    holds that rank's experts (load_checkpoint's keys, or shard_store), the cache its L x E_r keys, and
    decode_routed / prefill_routed its experts' partial sums, which moe.engine.expert_parallel.ExpertParallelMoE
    adds over the ranks.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 split: MissSplit | None = None, shard: ExpertShard | None = None, **constants) -> None:
        self.cfg, self.store, self.shard = weights.spec.moe, weights.store, shard
        experts = self.cfg.num_experts if shard is None else shard.experts
        if shard is not None and split is not None and not split.copies_all:
            raise ValueError(f"--moe-miss-service {split.service} with expert parallelism: the ranks would share "
                             f"one host's cores; serve the misses by copy")
        layers = weights.spec.num_moe_layers
        if self.store.num_keys != layers * experts:
            raise ValueError(f"the HostStore holds {self.store.num_keys} expert rows, not {layers} MoE layers x "
                             f"{experts} experts" + (" (load the rank's: load_checkpoint's keys)" if shard else ""))
        if split is not None and not split.copies_all and max_batch > CPU_MAX_TOKENS:
            raise ValueError(f"--moe-miss-service {split.service} computes at most {CPU_MAX_TOKENS} rows on the CPU: "
                             f"lower --max-batch (got {max_batch})")
        if split is not None and split.tail and split.inter != self.cfg.expert_intermediate:
            raise ValueError(f"a miss split's tail cuts experts {split.inter} wide, the model's are "
                             f"{self.cfg.expert_intermediate} (MoEConfig.expert_intermediate): build it for this model")
        split = split_for_slots(split, num_slots, weights.spec.num_moe_layers * experts)
        self.cache = HostCache(_geometry(weights, num_slots, max_batch, experts), policy, split=split, **constants)
        self.scratch = num_slots if self.cache.split.tail else None  # a split expert's rows [cut, I)
        self.pool = SlotPool(self.store.banks, num_slots + (self.scratch is not None), device="cpu")
        if self.scratch is not None:  # its rows below a cut are read (times a zeroed act) before a tail fills them
            self.pool.zero_slot(self.scratch)
        self.prefill_counts = [0, 0]  # prefill's used experts: [streamed from the store, read from a slot]
        self.cpu_experts = None if self.cache.split.copies_all else CpuExperts(self.store, self.cfg)

    @property
    def extra_slots(self) -> int:
        """Pool slots beyond the cache's: 1 for the scratch slot of a split with a tail, else 0."""
        return int(self.scratch is not None)

    def check(self) -> None:
        """Nothing to check: the CPU share is computed in line (an error raises in decode)."""

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] -> (out [B, H], ids [B, k] int32): decode_routed plus the shared expert, cast once."""
        out, ids = self.decode_routed(w, hidden)
        if w.shared is not None:
            out = out + shared_expert(hidden, w.shared)
        return out.to(hidden.dtype), ids

    def decode_routed(self, w: MoEWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] -> (the routed experts' sum [B, H] float32, ids [B, k] int32 as routed; with a
        shard, the sum of the rank's experts alone). Cost: one ensure, copies * 3 * I * H copied, B * k *
        3 * I * H routed multiply-adds (those of served misses read from the store)."""
        cfg = self.cfg
        weights, ids = route_block(hidden, w.router, cfg, w.router_bias, w.score_bias)  # [B, k]
        query = ids if self.shard is None else self.shard.local_ids(ids)
        res = self.cache.ensure(w.index, query.numpy())
        if res.copies:
            count = torch.tensor([res.copies], dtype=torch.int32)
            reference_copy(self.store, self.pool, torch.from_numpy(res.plan), count)
        slots, act_cut, split = res.slots.copy(), None, None
        served = res.slots == CPU_SLOT
        rows = self.cache.split.link_rows_given(res.copies + res.served.shape[0], res.copies) if served.any() else 0
        if rows:  # the tail: the first served expert's rows [cut, I) from the scratch slot, as the device splits it
            expert, inter = int(ids.numpy()[served][0]), cfg.expert_intermediate
            cut = inter - rows
            reference_tail_copy(self.store, self.pool, w.index * cfg.num_experts + expert, self.scratch, cut, inter)
            mask = served & (ids.numpy() == expert)
            slots[mask] = self.scratch
            act_cut, split = torch.from_numpy(np.where(mask, cut, 0)), (expert, cut)
        out = routed_reference(hidden, torch.from_numpy(slots), weights, *expert_matrices(self.pool, cfg),
                               cfg=cfg, act_cut=act_cut, **expert_biases(self.pool, cfg))  # [B, H] f32; CPU_SLOT adds 0
        if served.any():  # the split's CPU share, from the store in place
            mine = np.where(served, ids.numpy(), -1).astype(np.int32)
            out = out + torch.from_numpy(self.cpu_experts.moe(w.index, hidden.float().numpy(), mine,
                                                              weights.float().numpy(), split=split))
        return out, ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        resident = (torch.from_numpy(self.cache.slot_of), self.pool)
        return moe_prefill(self.store, self.cfg, w, hidden, resident, self.prefill_counts)

    def prefill_routed(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """moe_prefill_routed over this backend's store and slots (with the shard: its rank's experts)."""
        resident = (torch.from_numpy(self.cache.slot_of), self.pool)
        return moe_prefill_routed(self.store, self.cfg, w, hidden, resident, self.prefill_counts, shard=self.shard)


class GpuMoE:
    """The GPU backend: one moe.engine.layer.MoELayer per MoE layer over one shared moe.engine.layer.SlotCache.

    Built from the public constructors only. With `record`, the routed ids are a copy of what the
    layer routed with (MoELayer.last_routing, or the forced ids), made on the device, so a decode
    step that records stays capturable (moe.engine.graphs).
    forced_routing: route every decode call from static buffers instead of the router (benchmarks
    replaying a trace): `routing_buffers` ids int32 / weights float32 [L_moe, max_batch, k], filled per
    step with `set_routing` (ids -1 = no expert until then); prefill still uses the router.
    Raises what SlotPool (PoolError: the slots do not fit), SlotCache and MoELayer raise.
    """

    def __init__(self, weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 forced_routing: bool = False, split: MissSplit | None = None, **constants) -> None:
        geometry = _geometry(weights, num_slots, max_batch)
        split = split_for_slots(split, num_slots, geometry.num_layers * geometry.num_experts)
        self.cfg, self.store = weights.spec.moe, weights.store
        tail = split is not None and split.tail  # the scratch slot beside the cache's
        pool = SlotPool(self.store.banks, num_slots + tail, device=weights.device)
        self.slots = SlotCache(self.store, pool, geometry.num_layers, geometry.num_experts, policy, split=split,
                               cfg=self.cfg, **constants)
        self.layers = {lw.mlp.index: MoELayer(self.cfg, lw.mlp.index, lw.mlp.router, self.slots, lw.mlp.shared,
                                              router_b=lw.mlp.router_bias, score_bias=lw.mlp.score_bias)
                       for lw in weights.layers if isinstance(lw.mlp, MoEWeights)}
        self.routing_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefill_counts = [0, 0]  # prefill's used experts: [streamed from the store, read from a slot]
        self.staging = (PrefillStaging(self.store, PREFILL_STAGING, weights.device) if weights.device.type == "cuda"
                        else None)  # under Triton's interpreter on the CPU nothing is copied ahead
        if forced_routing:
            shape, dev = (geometry.num_layers, max_batch, self.cfg.top_k), weights.device
            self.routing_buffers = (torch.full(shape, -1, dtype=torch.int32, device=dev),
                                    torch.zeros(shape, dtype=torch.float32, device=dev))

    @property
    def extra_slots(self) -> int:
        """Pool slots beyond the cache's (SlotCache.extra_slots): the scratch slot of a split with a tail."""
        return self.slots.extra_slots

    def set_routing(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Forced routing of the next decode step: ids int32, weights float32 [L_moe, B, k] (any device;
        on the model's device no host sync) into rows 0..B-1 of `routing_buffers`. Rows B.. keep
        theirs. Raises ValueError naming forced_routing (not enabled) or ids / weights (shape, dtype)."""
        if self.routing_buffers is None:
            raise ValueError("set_routing needs GpuMoE(..., forced_routing=True)")
        bids, bweights = self.routing_buffers
        for name, t, dtype in (("ids", ids, torch.int32), ("weights", weights, torch.float32)):
            ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == 3
            ok = ok and t.shape[0] == bids.shape[0] and 1 <= t.shape[1] <= bids.shape[1] and t.shape[2] == bids.shape[2]
            if not ok:
                raise ValueError(f"set_routing: {name} must be {dtype} [L_moe={bids.shape[0]}, B <= "
                                 f"max_batch={bids.shape[1]}, k={bids.shape[2]}], got "
                                 f"{list(getattr(t, 'shape', []))} {getattr(t, 'dtype', type(t).__name__)}")
        if ids.shape != weights.shape:
            raise ValueError(f"set_routing: ids {list(ids.shape)} and weights {list(weights.shape)} differ in shape")
        b = ids.shape[1]
        bids[:, :b].copy_(ids, non_blocking=True)
        bweights[:, :b].copy_(weights, non_blocking=True)

    def check(self) -> None:
        """Raise RuntimeError with a CPU worker's failure since the last call (a host attribute: no sync).
        Engine.decode_step calls it before each step, eager or replayed: a failed worker answered with
        zeros, so the step it failed in lacks its share, and the next one raises."""
        if self.slots.share is not None:
            self.slots.share.check()

    def decode(self, w: MoEWeights, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer, b = self.layers[w.index], hidden.shape[0]
        routing = None
        if self.routing_buffers is not None:  # [b, k] views of [L_moe, max_batch, k]: contiguous
            routing = (self.routing_buffers[0][w.index, :b], self.routing_buffers[1][w.index, :b])
        out = layer.forward(hidden.contiguous(), routing)
        ids = None
        if record:  # what it routed with, copied on the device
            ids = (layer.last_routing(b)[1] if routing is None else routing[0]).clone()
        return out, ids

    def prefill(self, w: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        """Eager, on the current stream, after the decode steps queued before it (their miss copies
        filled the slots it reads); the experts without a slot stream through self.staging's ring, their
        copies on its stream overlapping the compute. One host sync for the layer's counts and slot ids."""
        slots = self.slots
        return moe_prefill(self.store, self.cfg, w, hidden, (slots.cache.slot_of, slots.pool), self.prefill_counts,
                           self.staging)


def make_backend(weights: ModelWeights, num_slots: int, policy: str = "lru", *, max_batch: int = 1,
                 split: MissSplit | None = None, **constants) -> CpuCachedMoE | GpuMoE:
    """GpuMoE when the weights are on a CUDA device, else CpuCachedMoE; split: the miss split (None: copy)."""
    cls = GpuMoE if weights.device.type == "cuda" else CpuCachedMoE
    return cls(weights, num_slots, policy, max_batch=max_batch, split=split, **constants)
