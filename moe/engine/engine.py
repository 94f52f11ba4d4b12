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

from collections.abc import Sequence

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
        if max_batch < 1 or max_seq_len < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch={max_batch}, max_seq_len={max_seq_len} and prefill_chunk={prefill_chunk} "
                             "must be >= 1")
        if prefix_blocks and prefill_chunk % prefix_block_tokens:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be a multiple of prefix_block_tokens="
                             f"{prefix_block_tokens} with a prefix cache")
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
        self._seq: list[list[int]] = []
        self._cached: list[int] = []
        self._chain: list[tuple[int, int, int]] = []
        # with linear-attention layers: the snapshot a row's decode took last, (block id, its generation),
        # freed when the row takes the next one
        self._latest: list[tuple[int, int] | None] = []
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
        list of B tensors [T_b, V], the logits after every prompt token. Resets the KV cache; leaves
        the expert cache untouched. Raises ValueError naming max_batch, max_seq_len or the token id.
        """
        prompts = [list(p) for p in prompts]
        if not 1 <= len(prompts) <= self.max_batch:
            raise ValueError(f"prefill got {len(prompts)} prompts; 1..max_batch={self.max_batch} fit")
        for prompt in prompts:
            self._check_prompt(prompt)
        self.kv.lengths.zero_()
        self._lengths, self._seq, self._cached, self._chain, self._latest = [], [], [], [], []
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
        if self.batch >= self.max_batch:
            raise ValueError(f"join: all max_batch={self.max_batch} rows are in use; leave a row first "
                             "or raise max_batch")
        self._check_prompt(prompt)
        return self._join(prompt, False)

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
        moved = [state.pop() for state in (self._seq, self._cached, self._chain, self._latest)]
        if row == last:
            return None
        self._seq[row], self._cached[row], self._chain[row], self._latest[row] = moved
        for k, v in zip(self.kv.k, self.kv.v):  # each [max_batch, Hkv, max_len, D], None at a linear layer
            if k is not None:
                k[row, :, :n] = k[last, :, :n]
                v[row, :, :n] = v[last, :, :n]
        if self.recurrent is not None:
            self.recurrent.move(last, row)
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

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of `row` restored from the prefix cache when it joined (0 without one)."""
        return self._cached[row]

    def _check_prompt(self, prompt: list[int]) -> None:
        if len(prompt) == 0:
            raise ValueError("prefill got an empty prompt: every prompt needs at least one token")
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens exceeds max_seq_len={self.max_seq_len}: "
                             "raise max_seq_len")

    def _join(self, prompt: list[int], all_logits: bool) -> tuple[int, torch.Tensor]:
        row = self.batch
        tokens = self._tokens(prompt)  # checks the ids before any row state changes
        if self.recurrent is not None:
            self.recurrent.reset(row)
        first, chain = 0, (0, ROOT, 0)
        if self.prefix is not None and not all_logits:  # all_logits wants every prompt token computed
            ids = self.prefix.match(prompt, len(prompt) - 1)  # at least the last token is computed
            first = self.prefix.restore(ids, self.kv, row, self.recurrent)
            if ids:
                chain = (len(ids), ids[-1], self.prefix.generation(ids[-1]))
        self._seq.append(list(prompt))
        self._cached.append(first)
        self._chain.append(chain)
        self._latest.append(None)
        try:
            logits = self._prefill_row(tokens, row, all_logits, first)
        except BaseException:  # the row did not join: its entries go, so later rows' stay in step
            for state in (self._seq, self._cached, self._chain, self._latest):
                state.pop()
            raise
        self._lengths.append(len(prompt))
        self.kv.lengths[row] = len(prompt)
        return row, logits

    def _prefill_row(self, tokens: torch.Tensor, row: int, all_logits: bool, first: int = 0) -> torch.Tensor:
        """The prompt from position `first` (those before it are in the row's KV: a restored prefix)
        through every layer in chunks of prefill_chunk tokens (activation memory bounded by a chunk; a
        chunk attends to the row's cached positions before it). With a prefix cache each chunk's whole
        blocks are saved as the layers compute their k, v; with linear-attention layers the last chunk
        ends at the prompt's last block boundary (the rest is one more chunk) and the state is saved
        at each chunk's end that is one."""
        logits = []
        total = tokens.shape[0]
        snapshots = self.prefix is not None and self.prefix.num_states > 0
        last_boundary = total // self.prefix.block_tokens * self.prefix.block_tokens if snapshots else 0
        start = first
        while start < total:
            end = min(start + self.prefill_chunk, total)
            if start < last_boundary < end:
                end = last_boundary
            res = self._reserve(row, start, end)
            tap = None if res is None else (lambda layer, at, k, v, r=res: self.prefix.write_chunk(r, layer, at, k, v))
            try:
                x = self.weights.embed[tokens[start:end]]  # [T_chunk, H]
                for i, lw in enumerate(self.weights.layers):
                    h = rms_norm(x, lw.input_norm, self.spec.rms_eps)
                    if isinstance(lw.attn, LinearAttentionWeights):
                        x = x + linear_attention_prefill(h[None], lw.attn, self.spec.linear,
                                                         self.recurrent.rows(i, row, row + 1))[0]
                    else:
                        x = x + attention_prefill(h, lw.attn, self.spec, self.rope, self.kv, i, row, start, tap)
                    h = rms_norm(x, lw.post_norm, self.spec.rms_eps)
                    x = x + (self.moe.prefill(lw.mlp, h) if isinstance(lw.mlp, MoEWeights) else _dense(lw.mlp, h))
            except BaseException:
                if res is not None:
                    self.prefix.release(res)
                raise
            if res is not None:
                self._extend_chain(row, self.prefix.commit(res))
            if snapshots and end % self.prefix.block_tokens == 0:
                self._save_state(row, end // self.prefix.block_tokens - 1)
            if all_logits:
                logits.append(self._logits(x))  # [T_chunk, V]
            start = end
        if all_logits:
            return torch.cat(logits)  # [T, V]
        return self._logits(x[-1:])[0]  # [V]

    def _chain_parent(self, row: int, block: int) -> int | None:
        """The id under which block `block` of `row` is saved (ROOT for block 0), or None where the
        row's saved chain does not reach it or its last block was evicted since."""
        count, last, gen = self._chain[row]
        if count != block or (count and not self.prefix.alive(last, gen)):
            return None
        return last

    def _extend_chain(self, row: int, ids: list[int]) -> None:
        if ids:
            count = self._chain[row][0]
            self._chain[row] = (count + len(ids), ids[-1], self.prefix.generation(ids[-1]))

    def _reserve(self, row: int, start: int, end: int):
        """The prefix cache's reservation of the whole blocks in prompt positions start..end-1 of `row`
        (start on a block boundary), after the blocks already cached; None without a cache or where the
        row's chain is broken."""
        if self.prefix is None:
            return None
        n = self.prefix.block_tokens
        first, last = start // n, end // n
        parent = self._chain_parent(row, first)
        if parent is None or first >= last:
            return None
        seq = self._seq[row]
        known = self.prefix.follow(seq, parent, first, last)
        self._extend_chain(row, known)
        parent = known[-1] if known else parent
        return self.prefix.reserve(seq, parent, first + len(known), last, keep={parent})

    def _save_decoded(self, fed: list[int]) -> None:
        """After a decode step: each row's fed token into its sequence, and a block it has just completed
        (its KV holds it) into the prefix cache."""
        n = self.prefix.block_tokens
        for row, token in enumerate(fed):
            seq = self._seq[row]
            seq.append(token)
            if len(seq) % n:
                continue
            block = len(seq) // n - 1
            parent = self._chain_parent(row, block)
            if parent is None:
                continue
            bid = self.prefix.save_from_row(seq, parent, block, self.kv, row, keep={parent})
            if bid is not None:
                self._extend_chain(row, [bid])
                if self.prefix.num_states:
                    self._save_latest(row, block)

    def _save_state(self, row: int, block: int) -> bool:
        """Snapshot `row`'s linear-attention state (at the end of its block `block`) into that block of
        its saved chain; False where the chain does not reach it or the block had one."""
        count, last, gen = self._chain[row]
        if count != block + 1 or not self.prefix.alive(last, gen):
            return False
        return self.prefix.save_state(last, self.recurrent, row)

    def _save_latest(self, row: int, block: int) -> None:
        """A decoded block's snapshot, replacing the one the row's decode took before (a sequence keeps
        the state at its last block boundary, not one per block)."""
        if not self._save_state(row, block):
            return
        prev, self._latest[row] = self._latest[row], self._chain[row][1:]
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
