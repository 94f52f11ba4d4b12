"""The decode engine: a loaded MoE checkpoint, a KV cache and an MoE backend -> logits and greedy tokens.

    prompts (B lists of ids) ──prefill──► per sequence b, all its tokens at once:
        embed [T, H] ─► per decoder layer: x += attn(rms(x)) (fills KV row b); x += mlp(rms(x))
        ─► rms(x) @ lm_headᵀ ─► logits [T, V]          (MoE layers: backend.prefill, cache bypassed)
    tokens [B] ──decode_step──► all B sequences together, one token each:
        embed [B, H] ─► per decoder layer: x += attn(rms(x)) at each row's own position;
                        x += mlp(rms(x))   (MoE layers: backend.decode → ensure, miss copy, routed)
                        (on CUDA each add fused into the norm after it, q / k norm + RoPE + KV write
                        in one launch, split-K attention over each row's own length:
                        moe.kernels.decode_norm, moe.kernels.decode_attention)
        ─► logits [B, V]; KV lengths += 1;   with record_routing: ids [L_moe, B, k] kept per step
    generate = prefill, then argmax → decode_step → argmax ... (greedy)
    on a CUDA device decode_step replays one captured CUDA graph per batch size B (moe.engine.graphs): the
    tokens go into a static buffer, every per-row state (KV, lengths) is read from device buffers

    prompt ──join──► prefill into row B (the next free row) while rows 0..B-1 keep their state; B += 1
        (with a prefix cache: the longest kept prefix restored into the row first, the rest prefilled)
    row ──leave──► swap-remove: the last row's KV (its cached positions only) moves into `row`; B -= 1
    prompt ──start_join──► Joining: its prefill in the spare row (the last, max_batch - 1), one chunk per
        `advance` call, between which decode steps run rows 0..B-1 (B <= max_batch - 1 meanwhile); the
        last chunk moves the row into row B (its cached positions) and B += 1, as join would have

Models with linear-attention layers (Qwen3-Next): such a layer (moe.engine.linear_attention) takes the place of
attention where ModelSpec.layer_types says so; its per-row state (conv window, delta-rule state) lives
in `recurrent` (RecurrentCache, allocated once like the KV cache, which then holds only the
full-attention layers): reset when a row joins, advanced in place by prefill (chunked delta rule) and
by every decode step (on a GPU the step kernel, captured in the decode graph; on the CPU its torch
reference, so the CPU backend launches no Triton kernel), moved with the row by `leave`.

Batching: sequences step together. Each row keeps its own length in the KV cache and attends only to
its own cached positions, so prompts of different lengths need no padding and no pad token; prefill
runs the prompts one after another (its attention is per sequence anyway), and every decode step
advances all B rows by one token. `prefill` replaces the whole batch; `join` / `leave` change it one
sequence at a time between decode steps (continuous batching, moe.serve.scheduler). The live rows are always
0..B-1: `leave` compacts by moving the last row into the freed one, so a decode step never computes a
dead row (whose routing would pollute the expert cache) and attention keeps its fixed row range.
The expert cache (the backend's) persists across batches, so a new sequence starts from the current
decode working set.
Legend: B = sequences, T = prompt tokens, H = hidden, V = vocab, L_moe = MoE layers, k = top_k.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from moe.engine.attention import KVCache, Rope, attention_decode, attention_decode_fused, attention_prefill, rms_norm
from moe.engine.backends import MoEBackend
from moe.engine.budget import prefix_states as budget_prefix_states
from moe.engine.graphs import DecodeGraphs
from moe.engine.linear_attention import RecurrentCache, linear_attention_decode, linear_attention_prefill
from moe.engine.prefix import PREFIX_BLOCK_TOKENS, ROOT, PrefixCache
from moe.kernels.decode_norm import add_rms_norm
from moe.model.checkpoint import DenseWeights, LayerWeights, ModelWeights, MoEWeights
from moe.model.linear_attention import LinearAttentionWeights

PREFILL_CHUNK = 16384  # prompt tokens a prefill pass takes at once (a longer prompt runs in chunks)


def check_prefill_chunk(chunk: int, block_tokens: int = 0) -> None:
    """Raise ValueError naming --prefill-chunk unless it is an int >= 1, and with a prefix cache of
    `block_tokens`-token blocks (0: none) a multiple of them (a chunk saves whole blocks)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"--prefill-chunk must be a whole number of tokens >= 1 (prompt tokens a prefill pass "
                         f"takes at once), got {chunk!r}")
    if block_tokens and chunk % block_tokens:
        raise ValueError(f"--prefill-chunk {chunk} must be a multiple of the prefix cache's blocks of {block_tokens} "
                         "tokens (--kv-cache-gb)")


class Engine:
    """Runs a ModelWeights with `moe` (CpuCachedMoE or GpuMoE) for up to `max_batch` sequences of at
    most `max_seq_len` tokens (prompt + generated), prefilling a prompt prefill_chunk tokens at a time
    (PREFILL_CHUNK: a longer prompt's activations stay those of a chunk). record_routing: keep each decode step's routed
    expert ids (`routing()`), for an expertcache-trace/1 file. cuda_graphs: capture and replay decode
    steps per batch size (moe.engine.graphs; `graphs` holds them); None = on for a CUDA device, off on the
    CPU; False = eager GPU decode (debugging). prefix_blocks > 0: keep the KV of up to that many blocks of
    prefix_block_tokens prompt and generated tokens (moe.engine.prefix, `prefix`): a joining prompt
    restores the longest kept prefix it starts with and computes only the rest (`cached_tokens`); the
    blocks are saved as prefill computes them and as decode completes them. Greedy tokens are those of
    computing the whole prompt (the restored k, v are the ones computed then; the rest attends to them).
    Raises ValueError naming max_batch / max_seq_len when a batch or a sequence does not fit,
    cuda_graphs when it is True for a CPU model, and prefill_chunk / the prefix cache's options when
    they disagree.
    """

    def __init__(self, weights: ModelWeights, moe: MoEBackend, *, max_batch: int = 1, max_seq_len: int = 2048,
                 record_routing: bool = False, cuda_graphs: bool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, prefix_blocks: int = 0,
                 prefix_block_tokens: int = PREFIX_BLOCK_TOKENS, prefix_states: int | None = None) -> None:
        if max_batch < 1 or max_seq_len < 1:
            raise ValueError(f"max_batch={max_batch} and max_seq_len={max_seq_len} must be >= 1")
        check_prefill_chunk(prefill_chunk, prefix_block_tokens if prefix_blocks else 0)
        self.prefill_chunk = prefill_chunk
        on_cuda = weights.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, the model is on {weights.device}")
        self.weights, self.spec, self.moe = weights, weights.spec, moe
        # how misses are served and why (load_model sets what --moe-miss-service resolved to)
        self.miss_service = "--moe-miss-service copy: every miss copied into a slot"
        self.rope = Rope(self.spec.rotary_dim, self.spec.rope_theta, weights.device, self.spec.rope_yarn)
        self.kv = KVCache(self.spec, max_batch, max_seq_len, weights.dtype, weights.device)
        linear = self.spec.linear_layers  # Qwen3-Next's linear-attention layers keep a recurrent state instead
        self.recurrent = (RecurrentCache(self.spec.linear, linear, max_batch, weights.dtype, weights.device)
                          if linear else None)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        # kept prompt prefixes (moe.engine.prefix); per row: its token ids, its restored tokens, and its
        # saved chain of blocks (count, last id, that id's generation)
        if prefix_states is None:
            prefix_states = budget_prefix_states(self.spec, prefix_blocks, prefix_block_tokens)
        self.prefix = (PrefixCache(self.spec, self.kv, prefix_blocks, prefix_block_tokens, self.recurrent,
                                   prefix_states) if prefix_blocks else None)
        self._rows: list[_RowState] = []
        self._joining: Joining | None = None  # a prompt being prefilled chunk by chunk (start_join)
        self.record_routing = record_routing
        self._routing: list[torch.Tensor] = []  # per decode step: int32 [L_moe, B, k]
        self._lengths: list[int] = []  # host mirror of kv.lengths for the active batch
        # on a CUDA device the decode step's non-MoE part runs the fused Triton launches (_decode_body_fused);
        # their head-dim tiles need a power of two >= 16 (every supported family's), else the torch step
        d = self.spec.head_dim
        self._fused = on_cuda and d >= 16 and d & (d - 1) == 0
        use_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self._decode_body, max_batch, weights.device) if use_graphs else None

    @property
    def batch(self) -> int:
        """Sequences in the active batch (0 before the first prefill)."""
        return len(self._lengths)

    def prefill(self, prompts: Sequence[Sequence[int]], *, all_logits: bool = False):
        """Start a batch: prompts (B lists of token ids, lengths may differ) -> logits.

        Returns float32 [B, V], each row the logits after its prompt's last token; with all_logits, a
        list of B tensors [T_b, V], the logits after every prompt token. Without a prefix cache, prompts
        that fit one prefill chunk together go through one pass (join_many: each layer's experts fetched
        once for all of them; the same tokens as one by one, float32 logits to rounding); others, all_logits
        and a prefix cache (where a later prompt restores what an earlier one of the batch just kept) one
        by one. Resets the KV cache; leaves the expert cache untouched. Raises ValueError naming max_batch,
        max_seq_len or the token id.
        """
        prompts = [list(p) for p in prompts]
        if not 1 <= len(prompts) <= self.max_batch:
            raise ValueError(f"prefill got {len(prompts)} prompts; 1..max_batch={self.max_batch} fit")
        for prompt in prompts:
            self._check_prompt(prompt)
        if self._joining is not None:
            raise ValueError("prefill: a prompt is still joining chunk by chunk (start_join); finish it with "
                             "advance or drop it with abort_join first")
        self.kv.lengths.zero_()
        self._lengths, self._rows = [], []
        if (not all_logits and self.prefix is None and len(prompts) > 1
                and sum(map(len, prompts)) <= self.prefill_chunk):
            return torch.stack([logits for _, logits in self.join_many(prompts)])
        out = [self._join(prompt, all_logits)[1] for prompt in prompts]
        return out if all_logits else torch.stack(out)

    def join(self, prompt: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Add one sequence to the running batch: prefill `prompt` into row B (the next free row).

        Returns (row, logits float32 [V] after the prompt's last token). The other rows' KV and
        lengths are untouched, so they keep decoding in the next step together with the new one.
        Cost: one prefill of len(prompt) tokens (the expert cache is bypassed). Raises ValueError
        naming max_batch (no free row), max_seq_len (prompt too long) or an out-of-range token id.
        """
        prompt = list(prompt)
        if self.batch >= self.free_rows_limit:
            raise ValueError(f"join: all max_batch={self.max_batch} rows are in use{self._spare_note}; leave a row "
                             "first or raise max_batch")
        self._check_prompt(prompt)
        return self._join(prompt, False)

    def join_many(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, torch.Tensor]]:
        """Add several sequences in one prefill pass: rows B, B + 1, ... in the prompts' order, each
        layer's routed experts fetched once for all of them where separate joins fetch them once each
        (a burst of short requests: an agent's side calls). The tokens they compute (tokens_to_compute)
        must fit one prefill chunk together. Returns [(row, logits float32 [V] after that prompt's last
        token)], the same tokens as joining them one by one (float32 logits to rounding). With a prefix
        cache that keeps linear-attention states, whose snapshots split a prompt at its last block
        boundary, they join one by one. Raises ValueError naming max_batch, prefill_chunk, max_seq_len
        or an out-of-range token id; nothing changes then."""
        prompts = [list(p) for p in prompts]
        if not prompts:
            raise ValueError("join_many got no prompts")
        if self.batch + len(prompts) > self.free_rows_limit:
            raise ValueError(f"join_many: {len(prompts)} prompts do not fit the {self.free_rows_limit - self.batch} "
                             f"free rows of max_batch={self.max_batch}{self._spare_note}; raise max_batch")
        for prompt in prompts:
            self._check_prompt(prompt)
        tokens = [self._tokens(prompt) for prompt in prompts]  # every id checked before any row changes
        computed = sum(self.tokens_to_compute(prompt) for prompt in prompts)
        if computed > self.prefill_chunk:
            raise ValueError(f"join_many: the prompts compute {computed} tokens together, more than "
                             f"prefill_chunk={self.prefill_chunk}: join fewer at once")
        if self.prefix is not None and self.prefix.num_states > 0:
            return self._join_each(prompts)
        # every kept prefix restored before any reservation, so none evicts what a later row restores (the
        # pass stays within its chunk); the blocks the rows' new ones hang from are spared by them all
        begun = [self._begin_row(prompt, self.batch + k, False) for k, prompt in enumerate(prompts)]
        held = {st.chain[1] for st, _ in begun}
        segments, reserved = [], []
        try:
            for k, (prompt, (st, first)) in enumerate(zip(prompts, begun)):
                res = self._reserve(st, first, len(prompt), held)
                if res is not None:
                    self.prefix.trim(res, {key for r in reserved if r is not None for key in r.keys})
                    held.add(st.chain[1])
                tap = None if res is None else (lambda layer, at, k_, v, r=res: self.prefix.write_chunk(r, layer, at,
                                                                                                         k_, v))
                reserved.append(res)
                segments.append((self.batch + k, first, len(prompt) - first, tap))
            ids = torch.cat([t[first:] for t, (_, first, _, _) in zip(tokens, segments)])
            x = self._layers(self.weights.embed[ids], segments)  # [sum of computed tokens, H]
            last = torch.tensor([n for _, _, n, _ in segments], device=x.device).cumsum(0) - 1
            logits = self._logits(x[last])  # [n, V]
        except BaseException:
            for res in reserved:
                if res is not None:
                    self.prefix.release(res)
            raise
        out = []
        for k, (prompt, (st, _), res) in enumerate(zip(prompts, begun, reserved)):
            if res is not None:
                self._extend_chain(st, self.prefix.commit(res))
            row = self.batch
            self._rows.append(st)
            self._lengths.append(len(prompt))
            self.kv.lengths[row] = len(prompt)
            out.append((row, logits[k]))
        if self.prefix is not None:  # a row whose blocks an earlier row of the pass wrote: its chain through them
            n = self.prefix.block_tokens
            for st, _ in begun:
                parent = self._chain_parent(st, st.chain[0])
                if parent is not None:
                    self._extend_chain(st, self.prefix.follow(st.seq, parent, st.chain[0], len(st.seq) // n))
        return out

    def _join_each(self, prompts: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        """join of each prompt in turn, all or none: a failure leaves the rows it had added."""
        out = []
        try:
            for prompt in prompts:
                out.append(self._join(prompt, False))
        except BaseException:
            for row, _ in reversed(out):
                self.leave(row)
            raise
        return out

    @property
    def free_rows_limit(self) -> int:
        """The batch size join may grow to: max_batch, less the spare row while a prompt joins in chunks."""
        return self.max_batch - (self._joining is not None)

    @property
    def _spare_note(self) -> str:
        return "" if self._joining is None else " (one of them by the prompt joining in chunks)"

    def tokens_to_compute(self, prompt: Sequence[int]) -> int:
        """The prompt tokens a join would compute now: all of them, less the prefix the prefix cache would
        restore (nothing changes)."""
        cached = 0 if self.prefix is None else self.prefix.peek(prompt, len(prompt) - 1)
        return len(prompt) - cached

    @property
    def joining(self) -> Joining | None:
        """The prompt being prefilled chunk by chunk (start_join), or None."""
        return self._joining

    def start_join(self, prompt: Sequence[int]) -> Joining:
        """Begin prefilling `prompt` in the spare row (max_batch - 1), one prefill chunk per `advance`
        call, so decode steps of rows 0..B-1 can run between its chunks (a long prompt beside streaming
        sequences). With a prefix cache its longest kept prefix is restored first. One prompt joins
        this way at a time, and join keeps the batch below max_batch meanwhile (the spare row is the
        last). Raises ValueError naming max_batch (no spare row), max_seq_len or an out-of-range token
        id; nothing changes then."""
        prompt = list(prompt)
        if self._joining is not None:
            raise ValueError("start_join: a prompt is already joining chunk by chunk; finish it first")
        if self.batch >= self.max_batch:
            raise ValueError(f"start_join: all max_batch={self.max_batch} rows are in use; leave a row first or "
                             "raise max_batch")
        self._check_prompt(prompt)
        row = self.max_batch - 1
        tokens = self._tokens(prompt)
        st, first = self._begin_row(prompt, row, False)
        self._joining = Joining(prompt, row, st, self._prefill_chunks(tokens, row, st, False, first))
        return self._joining

    def advance(self, joining: Joining) -> tuple[int, torch.Tensor] | None:
        """Prefill the next chunk of `joining` (start_join's). Returns None while chunks remain; after the
        last, (row, logits float32 [V] after the prompt's last token): the sequence is then row B of the
        batch, as join returns it. A chunk that raises drops the joining prompt (nothing of it stays)."""
        if joining is not self._joining:
            raise ValueError("advance: not the prompt joining now (start_join)")
        try:
            next(joining.chunks)
            return None
        except StopIteration as done:
            logits = done.value
        except BaseException:
            self._joining = None
            raise
        self._joining = None
        row = self.batch
        if joining.row != row:  # the spare row's cached positions move down to row B
            self._move_row(joining.row, row, len(joining.prompt))
        self._rows.append(joining.state)
        self._lengths.append(len(joining.prompt))
        self.kv.lengths[row] = len(joining.prompt)
        return row, logits

    def abort_join(self, joining: Joining) -> None:
        """Drop the prompt joining chunk by chunk (its request went away); the blocks its finished chunks
        saved into the prefix cache stay there."""
        if joining is self._joining:
            joining.chunks.close()
            self._joining = None

    def leave(self, row: int) -> int | None:
        """Free `row` by swap-remove: the last row's sequence moves into `row`; B -= 1.

        Returns the old index of the moved row (B - 1 before the call), or None when `row` was the
        last one. Callers that track sequences by row mirror it: seqs[row] = seqs.pop() (or pop).
        Cost: per decoder layer, a copy of the moved row's cached k, v (its length only).
        Raises ValueError when `row` is not in 0..B-1.
        """
        last = self.batch - 1
        if not 0 <= row <= last:
            raise ValueError(f"leave: row {row} is not an active row (0..{last})")
        n = self._lengths.pop()
        moved = self._rows.pop()
        if row == last:
            return None
        self._rows[row] = moved
        self._move_row(last, row, n)
        self.kv.lengths[row] = n
        self._lengths[row] = n
        return last

    def context_state(self) -> list[torch.Tensor]:
        """Every per-sequence buffer of the decoder, in layer order: the full-attention layers' k and v
        caches, then the linear-attention layers' conv and delta states (what a row's context is)."""
        kv = [t for pair in zip(self.kv.k, self.kv.v) for t in pair if t is not None]
        states = [] if self.recurrent is None else self.recurrent.states.values()
        rec = [t for st in states for t in (st.conv, st.delta)]
        return kv + rec

    def lengths(self) -> list[int]:
        """Tokens cached per active row (prompt + decoded tokens fed back), a host copy [B]."""
        return list(self._lengths)

    def _move_row(self, src: int, dst: int, n: int) -> None:
        """Physical row `src`'s first n cached positions (a ring's whole window) and recurrent state into
        row `dst`."""
        for k, v in zip(self.kv.k, self.kv.v):  # each [max_batch, Hkv, max_len, D], None at a linear layer
            if k is not None:
                k[dst, :, :n] = k[src, :, :n]
                v[dst, :, :n] = v[src, :, :n]
        if self.recurrent is not None:
            self.recurrent.move(src, dst)

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of `row` restored from the prefix cache when it joined (0 without one)."""
        return self._rows[row].cached

    def _check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) == 0:
            raise ValueError("prefill got an empty prompt: every prompt needs at least one token")
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens exceeds max_seq_len={self.max_seq_len}: "
                             "raise max_seq_len")

    def _begin_row(self, prompt: list[int], row: int, all_logits: bool) -> tuple[_RowState, int]:
        """A joining sequence's state in physical row `row`: its recurrent state reset and the longest
        kept prefix restored (with a prefix cache); (its _RowState, the restored tokens)."""
        if self.recurrent is not None:
            self.recurrent.reset(row)
        st = _RowState(list(prompt))
        if self.prefix is not None and not all_logits:  # all_logits wants every prompt token computed
            ids = self.prefix.match(prompt, len(prompt) - 1)  # at least the last token is computed
            st.cached = self.prefix.restore(ids, self.kv, row, self.recurrent)
            if ids:
                st.chain = (len(ids), ids[-1], self.prefix.generation(ids[-1]))
        return st, st.cached

    def _join(self, prompt: list[int], all_logits: bool) -> tuple[int, torch.Tensor]:
        row = self.batch
        tokens = self._tokens(prompt)  # checks the ids before any row state changes
        st, first = self._begin_row(prompt, row, all_logits)
        chunks = self._prefill_chunks(tokens, row, st, all_logits, first)
        while True:  # the row joins only once every chunk is done: a failure leaves the batch as it was
            try:
                next(chunks)
            except StopIteration as done:
                logits = done.value
                break
        self._rows.append(st)
        self._lengths.append(len(prompt))
        self.kv.lengths[row] = len(prompt)
        return row, logits

    def _prefill_chunks(self, tokens: torch.Tensor, row: int, st: _RowState, all_logits: bool, first: int = 0):
        """The prompt from position `first` (those before it are in the row's KV: a restored prefix)
        through every layer in chunks of prefill_chunk tokens (activation memory bounded by a chunk; a
        chunk attends to the row's cached positions before it), a generator that yields after each chunk
        but the last and returns the logits. With a prefix cache each chunk's whole blocks are saved as
        the layers compute their k, v; with linear-attention layers the last chunk ends at the prompt's
        last block boundary (the rest is one more chunk) and the state is saved at each chunk's end
        that is one."""
        logits = []
        total = tokens.shape[0]
        snapshots = self.prefix is not None and self.prefix.num_states > 0
        last_boundary = total // self.prefix.block_tokens * self.prefix.block_tokens if snapshots else 0
        start = first
        while True:
            end = min(start + self.prefill_chunk, total)
            if start < last_boundary < end:
                end = last_boundary
            res = self._reserve(st, start, end)
            tap = None if res is None else (lambda layer, at, k, v, r=res: self.prefix.write_chunk(r, layer, at, k, v))
            try:
                x = self._layers(self.weights.embed[tokens[start:end]], [(row, start, end - start, tap)])
            except BaseException:
                if res is not None:
                    self.prefix.release(res)
                raise
            if res is not None:
                self._extend_chain(st, self.prefix.commit(res))
            if snapshots and end % self.prefix.block_tokens == 0:
                self._save_state(st, row, end // self.prefix.block_tokens - 1)
            if all_logits:
                logits.append(self._logits(x))  # [T_chunk, V]
            if end == total:
                return torch.cat(logits) if all_logits else self._logits(x[-1:])[0]  # [T, V] / [V]
            start = end
            yield

    def _layers(self, x: torch.Tensor, segments: list) -> torch.Tensor:
        """x [T, H] (the embedded tokens of one or more rows, one after another) through every decoder
        layer. segments: per row, in x's order, (physical row, the position its first token takes, its
        token count, the prefix cache's k/v tap or None): attention runs per row over its own KV, the
        MoE and dense MLPs once over all T tokens (each layer's routed experts fetched once)."""
        for i, lw in enumerate(self.weights.layers):
            h = rms_norm(x, lw.input_norm, self.spec.rms_eps)
            parts, lo = [], 0
            for row, start, n, tap in segments:
                if isinstance(lw.attn, LinearAttentionWeights):
                    parts.append(linear_attention_prefill(h[None, lo:lo + n], lw.attn, self.spec.linear,
                                                          self.recurrent.rows(i, row, row + 1))[0])
                else:
                    parts.append(attention_prefill(h[lo:lo + n], lw.attn, self.spec, self.rope, self.kv, i, row,
                                                   start, tap))
                lo += n
            x = x + (parts[0] if len(parts) == 1 else torch.cat(parts))
            h = rms_norm(x, lw.post_norm, self.spec.rms_eps)
            x = x + (self.moe.prefill(lw.mlp, h) if isinstance(lw.mlp, MoEWeights) else _dense(lw.mlp, h))
        return x

    def _chain_parent(self, st: _RowState, block: int) -> int | None:
        """The id under which block `block` of a sequence is saved (ROOT for block 0), or None where its
        saved chain does not reach it or its last block was evicted since."""
        count, last, gen = st.chain
        if count != block or (count and not self.prefix.alive(last, gen)):
            return None
        return last

    def _extend_chain(self, st: _RowState, ids: list[int]) -> None:
        if ids:
            st.chain = (st.chain[0] + len(ids), ids[-1], self.prefix.generation(ids[-1]))

    def _reserve(self, st: _RowState, start: int, end: int, held: set[int] = frozenset()):
        """The prefix cache's reservation of the whole blocks in prompt positions start..end-1 of a
        sequence (start on a block boundary), after the blocks already cached; None without a cache or
        where its chain is broken. held: blocks its evictions must spare (other rows' joining at once)."""
        if self.prefix is None:
            return None
        n = self.prefix.block_tokens
        first, last = start // n, end // n
        parent = self._chain_parent(st, first)
        if parent is None or first >= last:
            return None
        known = self.prefix.follow(st.seq, parent, first, last)
        self._extend_chain(st, known)
        parent = known[-1] if known else parent
        return self.prefix.reserve(st.seq, parent, first + len(known), last, keep={parent, *held})

    def _save_decoded(self, fed: list[int]) -> None:
        """After a decode step: each row's fed token into its sequence, and a block it has just completed
        (its KV holds it) into the prefix cache."""
        n = self.prefix.block_tokens
        for row, token in enumerate(fed):
            st = self._rows[row]
            st.seq.append(token)
            if len(st.seq) % n:
                continue
            block = len(st.seq) // n - 1
            parent = self._chain_parent(st, block)
            if parent is None:
                continue
            bid = self.prefix.save_from_row(st.seq, parent, block, self.kv, row, keep={parent})
            if bid is not None:
                self._extend_chain(st, [bid])
                if self.prefix.num_states:
                    self._save_latest(st, row, block)

    def _save_state(self, st: _RowState, row: int, block: int) -> bool:
        """Snapshot physical row `row`'s linear-attention state (at the end of the sequence's block
        `block`) into that block of its saved chain; False where the chain does not reach it or the
        block had one."""
        count, last, gen = st.chain
        if count != block + 1 or not self.prefix.alive(last, gen):
            return False
        return self.prefix.save_state(last, self.recurrent, row)

    def _save_latest(self, st: _RowState, row: int, block: int) -> None:
        """A decoded block's snapshot, replacing the one the row's decode took before (a sequence keeps
        the state at its last block boundary, not one per block)."""
        if not self._save_state(st, row, block):
            return
        prev, st.latest = st.latest, st.chain[1:]
        if prev is not None and self.prefix.alive(*prev):
            self.prefix.drop_state(prev[0])

    def decode_step(self, tokens) -> torch.Tensor:
        """One token for every sequence of the active batch: tokens [B] ids -> logits float32 [B, V].

        Appends each token at its row's position (with a prefix cache, the ids go into the rows' sequences:
        a device tensor of them is read back, a host list is not). Raises ValueError naming max_seq_len when a row is
        full, or when no batch was started (call prefill first); RuntimeError when a CPU expert worker
        failed in an earlier step (the backend's check).
        """
        b = self.batch
        fed = tokens if isinstance(tokens, list) else None  # the host's own copy, when it has one
        tokens = self._tokens(tokens)
        if b == 0 or tokens.shape != (b,):
            raise ValueError(f"decode_step needs one token per sequence of the active batch ({b}; call "
                             f"prefill first), got shape {list(tokens.shape)}")
        if max(self._lengths) >= self.max_seq_len:
            raise ValueError(f"a sequence reached max_seq_len={self.max_seq_len}: raise max_seq_len")
        self.moe.check()  # a CPU expert worker's failure in an earlier step (GpuMoE.check)
        logits, routing = self._decode_body(tokens) if self.graphs is None else self.graphs.run(tokens)
        self._lengths = [n + 1 for n in self._lengths]
        if self.prefix is not None:  # the fed ids, read back from the device when the caller passed a tensor
            self._save_decoded([int(t) for t in fed] if fed is not None else tokens.tolist())
        if self.record_routing:
            self._routing.append(routing)  # [L_moe, B, k]
        return logits

    def _decode_body(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device work of one decode step (what moe.engine.graphs captures): tokens int64 [B] on the device
        -> (logits float32 [B, V], routed ids int32 [L_moe, B, k] when recording, else None). Writes
        each row's k, v at its position and advances kv.lengths[:B]; no host sync, no host state."""
        if self._fused:
            return self._decode_body_fused(tokens)
        b = tokens.shape[0]
        x = self.weights.embed[tokens]  # [B, H]
        step_ids = []
        for i, lw in enumerate(self.weights.layers):
            h = rms_norm(x, lw.input_norm, self.spec.rms_eps)
            x = x + (self._linear_decode(h, lw.attn, i, b) if isinstance(lw.attn, LinearAttentionWeights)
                     else attention_decode(h, lw.attn, self.spec, self.rope, self.kv, i, b))
            x = x + self._decode_mlp(lw, rms_norm(x, lw.post_norm, self.spec.rms_eps), step_ids)
        self.kv.lengths[:b] += 1
        return self._logits(x), torch.stack(step_ids) if self.record_routing else None

    def _decode_body_fused(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """_decode_body with each residual add fused into the RMSNorm after it (moe.kernels.decode_norm:
        the attention's output with the post-attention norm, the MLP's with the next layer's input
        norm or the final norm) and attention_decode_fused: the same result up to sum orders."""
        b, eps = tokens.shape[0], self.spec.rms_eps
        x = self.weights.embed[tokens]  # [B, H], the residual stream
        pending = None  # the last sublayer's output, not yet added to x
        step_ids = []
        for i, lw in enumerate(self.weights.layers):
            x, h = add_rms_norm(x, lw.input_norm, eps) if pending is None else \
                add_rms_norm(pending, lw.input_norm, eps, residual=x)
            a = (self._linear_decode(h, lw.attn, i, b) if isinstance(lw.attn, LinearAttentionWeights)
                 else attention_decode_fused(h, lw.attn, self.spec, self.rope, self.kv, i, b))
            x, h = add_rms_norm(a, lw.post_norm, eps, residual=x)
            pending = self._decode_mlp(lw, h, step_ids)
        _, h = add_rms_norm(pending, self.weights.norm, eps, residual=x)
        self.kv.lengths[:b] += 1
        logits = F.linear(h, self.weights.lm_head).float()
        return logits, torch.stack(step_ids) if self.record_routing else None

    def _linear_decode(self, h: torch.Tensor, w: LinearAttentionWeights, layer: int, b: int) -> torch.Tensor:
        """A linear-attention layer's decode of rows 0..b-1 (their recurrent state advanced in place)."""
        return linear_attention_decode(h, w, self.spec.linear, self.recurrent.rows(layer, 0, b))

    def _decode_mlp(self, lw: LayerWeights, h: torch.Tensor, step_ids: list) -> torch.Tensor:
        if isinstance(lw.mlp, DenseWeights):
            return _dense(lw.mlp, h)
        out, ids = self.moe.decode(lw.mlp, h, self.record_routing)
        if self.record_routing:
            step_ids.append(ids)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding: B prompts -> B lists of exactly max_new_tokens new token ids.

        One prefill and max_new_tokens - 1 decode steps (no stop tokens: every row runs to the end).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        tokens = self.prefill(prompts).argmax(dim=-1)  # [B]
        out = [tokens]
        for _ in range(max_new_tokens - 1):
            tokens = self.decode_step(tokens).argmax(dim=-1)
            out.append(tokens)
        return torch.stack(out, dim=1).tolist()

    def routing(self) -> np.ndarray:
        """Recorded decode routing, int32 [N, L_moe, B, k]: N decode steps in token-major decode order, as
        sim.trace's `experts`. B is the largest batch recorded; rows a smaller batch lacked are -1
        (the trace format's padding). Empty [0, L_moe, 0, k] before any recorded step. One host copy."""
        spec = self.spec
        rows = max((ids.shape[1] for ids in self._routing), default=0)
        out = np.full((len(self._routing), spec.num_moe_layers, rows, spec.moe.top_k), -1, dtype=np.int32)
        for n, ids in enumerate(self._routing):
            out[n, :, : ids.shape[1]] = ids.cpu().numpy()
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> float32 [N, V]: final RMSNorm, then lm_head in the model dtype."""
        return F.linear(rms_norm(x, self.weights.norm, self.spec.rms_eps), self.weights.lm_head).float()

    def _tokens(self, ids) -> torch.Tensor:
        """Token ids -> int64 tensor on the model's device. Host ids (lists, CPU tensors) are checked,
        raising ValueError naming an id outside [0, vocab_size); device tensors (the engine's own argmax)
        are trusted, so a GPU decode step reads nothing back."""
        t = torch.as_tensor(ids, dtype=torch.int64)
        if t.device.type == "cpu" and t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must be in [0, vocab_size={self.spec.vocab_size}), got "
                             f"{int(t.min())}..{int(t.max())}")
        return t.to(self.weights.device)


def _dense(w: DenseWeights, h: torch.Tensor) -> torch.Tensor:
    """Dense SiLU MLP in the model dtype: h [N, H] -> down(silu(gate(h)) * up(h)) [N, H]."""
    inter = w.down.shape[1]
    gu = F.linear(h, w.gate_up)  # [N, 2Id]
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w.down)


@dataclass
class _RowState:
    """A sequence's host state beside its KV row: its token ids (prompt and fed tokens), the prompt tokens
    restored from the prefix cache, its saved chain of blocks (count, last id, that id's generation),
    and with linear-attention layers the snapshot its decode took last (block id, generation), freed
    when it takes the next one."""

    seq: list[int]
    cached: int = 0
    chain: tuple[int, int, int] = (0, ROOT, 0)
    latest: tuple[int, int] | None = None


@dataclass(eq=False)
class Joining:
    """A prompt prefilled chunk by chunk (Engine.start_join): its ids, the spare row it fills, its
    sequence state and the generator of its chunks."""

    prompt: list[int]
    row: int
    state: _RowState
    chunks: Generator[None, None, torch.Tensor] = field(repr=False)
