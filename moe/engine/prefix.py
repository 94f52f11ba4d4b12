"""Prompt prefixes kept across requests: the KV of whole token blocks, found again by their content.

    tokens ─split─► blocks of `block_tokens` ids; block b's key = (the key's id of block b - 1, or ROOT,
        its ids): a chain, so a block is found only under the same whole prefix
    ──match──► the ids of the longest chain of cached blocks a prompt starts with (touched: most recent)
    ──restore──► a row's KV cache: per attention layer k, v [Hkv, s, D] of those blocks (s = blocks *
        block_tokens); a sliding layer's ring gets the last window positions of them, at p % window
    prefill chunk ──reserve──► ids for the chunk's whole blocks not yet cached (the least recently used
        leaf blocks evicted to make room) ──write (attention_prefill's tap, per layer)──► pool
        ──commit──► the blocks become findable; a chunk that fails frees what it reserved
    decode ──save_from_row──► a block a row has just completed, read from its KV (full layers at p,
        sliding layers at p % window, all its positions still in the ring)

The pool is allocated once: per softmax-attention layer k, v [num_blocks, Hkv, block_tokens, D] in the
model dtype. A row copies the blocks it restores into its own KV, so evicting a block later changes no
row. Eviction takes the least recently used block that no cached block extends (a leaf), so every
cached block's prefix stays cached. Keys hold the ids themselves, so two prompts share a block only
when their tokens are equal up to its end.

Linear-attention layers (Qwen3-Next) keep a recurrent state instead of per-position KV, so a row can
resume only where that state was saved: at a block boundary, as a snapshot of every linear layer's
state (conv window and delta-rule state) attached to the block that ends there. The cache then keeps
`num_states` snapshots beside its blocks (their own pool, least recently used evicted first; a block's
snapshot goes with it), and `match` restores the chain only up to its last block with a snapshot. The
engine takes them where a later prompt is likely to resume (`save_state`): at each prefill chunk's end,
at the prompt's last block boundary, and, during decode, at each block a row completes, keeping only
the row's latest (so a finished sequence leaves one at its last block boundary).
Legend: L = decoder layers, Hkv = kv heads, D = head dim, s = restored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.engine.attention import KVCache
from moe.engine.budget import PREFIX_BLOCK_TOKENS, check_prefix_cache
from moe.engine.linear_attention import RecurrentCache
from moe.model.spec import ModelSpec

ROOT = -1  # the parent of a chain's first block
__all__ = ["PREFIX_BLOCK_TOKENS", "ROOT", "PrefixCache", "PrefixStats", "Reservation"]


@dataclass
class PrefixStats:
    """Tokens asked for (prompts' lengths less the one each must compute), tokens restored, blocks
    written, blocks evicted: the server's cached_tokens and metrics."""

    queried: int = 0
    restored: int = 0
    written: int = 0
    evicted: int = 0
    states_written: int = 0
    states_evicted: int = 0


@dataclass
class _Block:
    key: tuple[int, tuple[int, ...]]
    children: int = 0
    tick: int = 0


@dataclass
class Reservation:
    """Blocks a prefill chunk will write: the sequence's blocks first, first + 1, ..., their pool ids and
    keys."""

    first: int
    ids: list[int] = field(default_factory=list)
    keys: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


class PrefixCache:
    """The prefix cache of one engine (module docstring).

    spec: the model's ModelSpec; kv: the engine's KVCache (layer shapes, rings); num_blocks: blocks the
    pool holds; block_tokens: tokens a block (a power of two; the engine's prefill chunk must be a
    multiple of it, and a sliding window at least it); recurrent, num_states: for a model with
    linear-attention layers, the engine's RecurrentCache and the state snapshots to keep (>= 1).
    Raises ValueError naming num_blocks, block_tokens, num_states, or --kv-cache-gb where
    moe.engine.budget.check_prefix_cache refuses the model.
    Cost: moe.engine.budget.prefix_block_bytes * num_blocks of device memory, plus num_states *
    prefix_state_bytes with linear-attention layers, allocated here.
    """

    def __init__(self, spec: ModelSpec, kv: KVCache, num_blocks: int, block_tokens: int = PREFIX_BLOCK_TOKENS,
                 recurrent: RecurrentCache | None = None, num_states: int = 0) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"prefix cache: num_blocks must be an int >= 1, got {num_blocks!r}")
        linear = bool(spec.linear_layers)
        if linear and (recurrent is None or isinstance(num_states, bool) or not isinstance(num_states, int)
                       or num_states < 1):
            raise ValueError("prefix cache: a model with linear-attention layers needs its RecurrentCache and "
                             f"num_states >= 1 (recurrent-state snapshots), got num_states={num_states!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1 \
                or block_tokens & (block_tokens - 1):
            raise ValueError(f"prefix cache: block_tokens must be a power of two, got {block_tokens!r}")
        check_prefix_cache(spec, block_tokens, kv.max_len)
        self.block_tokens, self.num_blocks, self.ring = block_tokens, num_blocks, list(kv.ring)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for k in kv.k:
            shape = None if k is None else (num_blocks, k.shape[1], block_tokens, k.shape[3])
            self.k.append(None if k is None else torch.zeros(shape, dtype=k.dtype, device=k.device))
            self.v.append(None if k is None else torch.zeros(shape, dtype=k.dtype, device=k.device))
        self.device = next(t.device for t in self.k if t is not None)
        # linear-attention state snapshots: per linear layer conv [S, C, K - 1], delta [S, Hv, Dk, Dv]; the
        # block each holds (its position: the block's end) and the block's snapshot
        self.num_states = num_states if linear else 0
        self.conv: dict[int, torch.Tensor] = {}
        self.delta: dict[int, torch.Tensor] = {}
        if linear:
            for layer, st in recurrent.states.items():
                self.conv[layer] = torch.zeros((num_states, *st.conv.shape[1:]), dtype=st.conv.dtype,
                                               device=st.conv.device)
                self.delta[layer] = torch.zeros((num_states, *st.delta.shape[1:]), dtype=st.delta.dtype,
                                                device=st.delta.device)
        self._state_of: dict[int, int] = {}  # block id -> its snapshot's id
        self._state_block: dict[int, int] = {}  # snapshot id -> its block's id
        self._state_tick = [0] * self.num_states
        self._free_states = list(range(self.num_states - 1, -1, -1))
        self._blocks: dict[int, _Block] = {}
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))
        self._gen = [0] * num_blocks  # advanced when a block is freed: a row's stale parent id is seen as such
        self._tick = 0
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def _touch(self, bid: int) -> None:
        self._tick += 1
        self._blocks[bid].tick = self._tick

    def _block_tokens(self, tokens, b: int) -> tuple[int, ...]:
        n = self.block_tokens
        return tuple(int(t) for t in tokens[b * n:(b + 1) * n])

    def match(self, tokens, limit: int) -> list[int]:
        """Ids of the longest chain of cached blocks `tokens` starts with, at most `limit` tokens of them
        (whole blocks), each touched. Counts limit as queried and the chain's tokens as restored."""
        out = self.follow(tokens, ROOT, 0, max(limit, 0) // self.block_tokens)
        out = self._resumable(out)
        if self.num_states and out:
            self._touch_state(self._state_of[out[-1]])
        self.stats.queried += max(limit, 0)
        self.stats.restored += len(out) * self.block_tokens
        return out

    def peek(self, tokens, limit: int) -> int:
        """The tokens `match` would restore now, touching and counting nothing."""
        found = self._chain(tokens, ROOT, 0, max(limit, 0) // self.block_tokens)
        return len(self._resumable(found)) * self.block_tokens

    def _resumable(self, chain: list[int]) -> list[int]:
        """The chain up to its last block a row can resume at: every block, or with linear-attention
        layers the last one holding a snapshot of their state."""
        if self.num_states:
            while chain and chain[-1] not in self._state_of:
                chain.pop()
        return chain

    def restore(self, ids: list[int], kv: KVCache, row: int, recurrent: RecurrentCache | None = None) -> int:
        """Copy blocks `ids` (a chain from match) into KV row `row` at positions 0..s-1, and with
        linear-attention layers the snapshot of the last one into the row of `recurrent`; returns s."""
        s = len(ids) * self.block_tokens
        if not ids:
            return 0
        if self.num_states:
            sid = self._state_of[ids[-1]]
            for layer, st in recurrent.states.items():
                st.conv[row].copy_(self.conv[layer][sid])
                st.delta[row].copy_(self.delta[layer][sid])
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        for layer, (pk, pv) in enumerate(zip(self.k, self.v)):
            if pk is None:
                continue
            for pool, dst in ((pk, kv.k[layer]), (pv, kv.v[layer])):
                blocks = pool[idx]  # [nb, Hkv, block, D]
                seq = blocks.transpose(0, 1).reshape(blocks.shape[1], s, blocks.shape[3])  # [Hkv, s, D]
                ring = self.ring[layer]
                if ring:
                    pos = torch.arange(max(0, s - ring), s, device=self.device)
                    dst[row, :, pos % ring] = seq[:, pos]
                else:
                    dst[row, :, :s] = seq
        return s

    def alive(self, bid: int, gen: int) -> bool:
        """Whether block `bid` still holds what it held at generation `gen` (from `generation`)."""
        return bid in self._blocks and self._gen[bid] == gen

    def generation(self, bid: int) -> int:
        return self._gen[bid]

    def follow(self, tokens, parent: int, first: int, end: int) -> list[int]:
        """Ids of blocks first, first + 1, ... (before end) of `tokens` already cached under `parent`,
        each touched, up to the first one that is not."""
        out = self._chain(tokens, parent, first, end)
        for bid in out:
            self._touch(bid)
        return out

    def _chain(self, tokens, parent: int, first: int, end: int) -> list[int]:
        """follow's ids, nothing touched."""
        out = []
        for b in range(first, end):
            parent = self._by_key.get((parent, self._block_tokens(tokens, b)))
            if parent is None:
                break
            out.append(parent)
        return out

    def _evict_one(self, keep: set[int]) -> int | None:
        """Free the least recently used leaf block not in `keep`; its id, or None when none is free."""
        leaves = [(b.tick, bid) for bid, b in self._blocks.items() if b.children == 0 and bid not in keep]
        if not leaves:
            return None
        _, bid = min(leaves)
        block = self._blocks.pop(bid)
        del self._by_key[block.key]
        self._gen[bid] += 1
        self.drop_state(bid)
        if block.key[0] != ROOT:
            self._blocks[block.key[0]].children -= 1
        self.stats.evicted += 1
        return bid

    def reserve(self, tokens, parent: int, first: int, end: int, keep: set[int]) -> Reservation:
        """Pool ids for blocks first..end-1 of `tokens` (whole blocks), the chain continuing from block
        id `parent` (ROOT for block 0). A block already cached is not written again: the reservation
        stops at the first one (its later blocks are found through match next time). Ids come from free
        blocks, else by evicting least recently used leaves outside `keep` and the reservation; when
        none is left the reservation ends there."""
        res = Reservation(first)
        held = set(keep) | ({parent} if parent != ROOT else set())
        prev = parent
        for b in range(first, end):
            key = (prev, self._block_tokens(tokens, b))
            if key in self._by_key:
                break
            bid = self._free.pop() if self._free else self._evict_one(held)
            if bid is None:
                break
            res.ids.append(bid)
            res.keys.append(key)
            held.add(bid)
            prev = bid
        return res

    def write_chunk(self, res: Reservation, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefill chunk's k, v [T, Hkv, D] (positions start..start+T-1) of decoder `layer` into the
        reserved blocks that chunk holds."""
        if not res.ids or self.k[layer] is None:
            return
        n = self.block_tokens
        lo = res.first * n - start
        nb = len(res.ids)
        idx = torch.tensor(res.ids, dtype=torch.long, device=self.device)
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            part = x[lo:lo + nb * n]  # [nb * block, Hkv, D]
            pool[idx] = part.reshape(nb, n, part.shape[1], part.shape[2]).transpose(1, 2)

    def commit(self, res: Reservation) -> list[int]:
        """Make the reserved blocks findable (written by write_chunk or save_from_row); their ids."""
        for bid, key in zip(res.ids, res.keys):
            self._blocks[bid] = _Block(key)
            self._by_key[key] = bid
            if key[0] != ROOT:
                self._blocks[key[0]].children += 1
            self._touch(bid)
        self.stats.written += len(res.ids)
        return list(res.ids)

    def trim(self, res: Reservation, taken: set) -> None:
        """Cut `res` at its first block whose key another reservation in flight holds (prompts joining
        in one pass that share blocks: the first one writes them), returning the ids from there on."""
        cut = next((i for i, key in enumerate(res.keys) if key in taken), len(res.keys))
        for bid in res.ids[cut:]:
            self._gen[bid] += 1
        self._free.extend(res.ids[cut:])
        del res.ids[cut:], res.keys[cut:]

    def release(self, res: Reservation) -> None:
        """Return a reservation's ids unwritten (its chunk failed)."""
        for bid in res.ids:
            self._gen[bid] += 1
        self._free.extend(res.ids)
        res.ids.clear()
        res.keys.clear()

    def save_from_row(self, tokens, parent: int, block: int, kv: KVCache, row: int, keep: set[int]) -> int | None:
        """Block `block` of a row's sequence (tokens: its ids, at least through that block), which its KV
        holds, into the pool as the child of `parent`; its id (the cached one when present), or None
        when no block could be freed for it."""
        known = self.follow(tokens, parent, block, block + 1)
        if known:
            return known[0]
        res = self.reserve(tokens, parent, block, block + 1, keep)
        if not res.ids:
            return None
        n, bid = self.block_tokens, res.ids[0]
        pos = torch.arange(block * n, (block + 1) * n, device=self.device)
        for layer, (pk, pv) in enumerate(zip(self.k, self.v)):
            if pk is None:
                continue
            at = pos % self.ring[layer] if self.ring[layer] else pos
            pk[bid] = kv.k[layer][row, :, at]
            pv[bid] = kv.v[layer][row, :, at]
        self.commit(res)
        return bid

    @property
    def snapshots(self) -> int:
        """Linear-attention state snapshots held now."""
        return len(self._state_of)

    def has_state(self, bid: int) -> bool:
        """Whether block `bid` holds a snapshot of the linear-attention state at its end."""
        return bid in self._state_of

    def _touch_state(self, sid: int) -> None:
        self._tick += 1
        self._state_tick[sid] = self._tick

    def save_state(self, bid: int, recurrent: RecurrentCache, row: int) -> bool:
        """Snapshot row `row`'s linear-attention state (which must be at block `bid`'s end) into block
        `bid`, a cached block; the least recently used snapshot is evicted when none is free. A block
        that has one keeps it (the same tokens gave it). Returns whether this call wrote one."""
        if not self.num_states or bid not in self._blocks:
            return False
        if bid in self._state_of:
            self._touch_state(self._state_of[bid])
            return False
        if not self._free_states:  # the least recently used snapshot goes (drop_state frees its id)
            self.drop_state(self._state_block[min(self._state_block, key=lambda i: self._state_tick[i])])
            self.stats.states_evicted += 1
        sid = self._free_states.pop()
        for layer, st in recurrent.states.items():
            self.conv[layer][sid].copy_(st.conv[row])
            self.delta[layer][sid].copy_(st.delta[row])
        self._state_of[bid], self._state_block[sid] = sid, bid
        self._touch_state(sid)
        self.stats.states_written += 1
        return True

    def drop_state(self, bid: int) -> None:
        """Free block `bid`'s snapshot, if it has one (the block stays cached)."""
        sid = self._state_of.pop(bid, None)
        if sid is not None:
            del self._state_block[sid]
            self._free_states.append(sid)
