"""The expert cache's size: `--moe-slots N`, or a VRAM budget `--moe-cache-gb G` turned into slots.

    config.json (+ --moe-expert-format) ─ModelSpec─► the HostStore's expert banks (MoEConfig.expert_banks):
        the banks of MoEConfig.expert_format (gate_up [2I, H] + down [H, I] in the model dtype for an
        unquantized model; values and scales for fp8 / nvfp4 / mxfp4 / int4) ─► P = bytes per expert = per slot
    --moe-slots N    ─► S = N                                   (refused below --max-batch x top_k or above L x E)
    --moe-cache-gb G ─► S = min(floor(G * 2**30 / P), L * E)    (refused below --max-batch x top_k)
both checked from config.json, before any weight is read; messages name the flags (the library's
load_model takes the same values as num_slots, cache_gb and max_batch) and count in words (`counted`).

The format priced is the one the experts are stored in (expertcache.formats): a bfloat16 model's experts
are "bf16" (2 bytes a parameter), a float16 / float32 model's unquantized banks of that dtype (2 / 4
bytes a parameter), a quantized checkpoint's or --moe-expert-format's fp8 (~1), nvfp4 / mxfp4 / int4
(~0.5); either way P is the banks' row bytes (slots_for_bytes).
The KV cache is the other per-request memory on the device: kv_cache_bytes = 2 (k, v) x full-attention
layers x max_batch x Hkv x max_seq_len x D x the model dtype's bytes, allocated at start
(moe.engine.attention.KVCache); a model with linear-attention layers (Qwen3-Next) adds their fixed-size
state per sequence (recurrent_state_bytes);
memory_split reports it beside the slots, the split between --moe-cache-gb (or --moe-slots) and
--max-batch x --max-seq-len that the server prints at start.
The model dtype is config.json's torch_dtype or the dtype= / --dtype override. A budget that holds
every expert gives L * E slots (a slot beyond them would never hold one) and says so in `describe`.
GiB are 2**30 bytes. Legend: L = MoE layers, E = routed experts per layer, S = slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertcache.formats import GIB, gib_at_least, slots_for_bytes
from expertcache.words import counted
from moe.engine.attention import cache_positions
from moe.engine.linear_attention import RecurrentCache
from moe.model.spec import ModelSpec

PREFILL_STAGING = 8  # experts in a GPU's prefill staging ring (moe.engine.backends.PrefillStaging)


@dataclass(frozen=True)
class SlotBudget:
    """A resolved cache size. slots: S. bytes_per_expert: P (one expert's rows over every bank, the bytes of one
    slot). format: the experts' expert-format key ("bf16", "float16", "float32", "fp8", "nvfp4", "int4-f16", ...).
    num_layers / num_experts: L MoE layers x E experts. cache_gb: the --moe-cache-gb budget (None for --moe-slots).
    budget_slots: floor(G * 2**30 / P) before the cap at L * E (None for --moe-slots)."""

    slots: int
    bytes_per_expert: int
    format: str
    num_layers: int
    num_experts: int
    cache_gb: float | None = None
    budget_slots: int | None = None

    @property
    def keys(self) -> int:
        """Routed experts of the model, L * E (the cache's keys)."""
        return self.num_layers * self.num_experts

    @property
    def slot_bytes(self) -> int:
        """Bytes of slot memory: S * P."""
        return self.slots * self.bytes_per_expert

    @property
    def capped(self) -> bool:
        """True when the budget held more experts than the model has (S was cut to L * E)."""
        return self.budget_slots is not None and self.budget_slots > self.keys

    def describe(self) -> str:
        """One line: slots, bytes per expert, GiB of slot memory, experts in all, and the budget."""
        line = (f"expert cache: {counted(self.slots, 'slot')} x {self.bytes_per_expert:,} bytes per {self.format} "
                f"expert = {self.slot_bytes / GIB:.4g} GiB of slot memory, for {counted(self.keys, 'expert')} "
                f"({counted(self.num_layers, 'MoE layer')} x {self.num_experts})")
        if self.cache_gb is None:
            return line
        line += f"; budget --moe-cache-gb {self.cache_gb:g} holds {self.budget_slots:,}"
        if self.capped:
            line += f", more than every expert: capped at {counted(self.keys, 'slot')}, every expert resident"
        return line


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_cache_bytes(spec: ModelSpec, max_batch: int, max_seq_len: int) -> int:
    """Bytes of the KV cache an Engine allocates: k and v [max_batch, Hkv, P, D] per softmax-attention
    decoder layer, P = max_seq_len or a sliding layer's window (moe.engine.attention.cache_positions), in
    the model dtype (moe.engine.attention.KVCache)."""
    positions = sum(cache_positions(spec, i, max_seq_len) for i in spec.full_layers)
    return 2 * positions * max_batch * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[spec.moe.dtype]


def recurrent_state_bytes(spec: ModelSpec, max_batch: int) -> int:
    """Bytes of the linear-attention layers' state an Engine allocates (moe.engine.linear_attention.RecurrentCache;
    0 without such layers): per layer and row a conv window and a float32 delta-rule state, whatever
    the context length."""
    if spec.linear is None:
        return 0
    return RecurrentCache.state_bytes(spec.linear, len(spec.linear_layers), max_batch, DTYPE_BYTES[spec.moe.dtype])


PREFIX_BLOCK_TOKENS = 64  # tokens of a prefix-cache block (moe.engine.prefix; --kv-cache-gb's blocks)


def prefix_block_bytes(spec: ModelSpec, block_tokens: int) -> int:
    """Bytes of one prefix-cache block (moe.engine.prefix): k and v of `block_tokens` positions in every
    softmax-attention layer, a sliding one's too, in the model dtype."""
    return 2 * len(spec.full_layers) * spec.num_kv_heads * block_tokens * spec.head_dim * DTYPE_BYTES[spec.moe.dtype]


def check_prefix_cache(spec: ModelSpec, block_tokens: int, max_seq_len: int) -> None:
    """Raise ValueError naming --kv-cache-gb where a prefix cache (moe.engine.prefix) cannot be kept: a
    sliding window that is a ring (shorter than the context, max_seq_len) and shorter than a block."""
    windows = [p for p in (cache_positions(spec, i, max_seq_len) for i in spec.full_layers) if p < max_seq_len]
    if windows and min(windows) < block_tokens:
        raise ValueError(f"--kv-cache-gb: the prefix cache's blocks of {block_tokens} tokens exceed the model's "
                         f"sliding window of {min(windows)}, and a block must fit in a ring; serve it without "
                         "--kv-cache-gb")


# a model with linear-attention layers keeps one snapshot of their recurrent state per this many tokens of
# kept blocks (at least PREFIX_MIN_STATES): a prefix restores only up to a block that has one
PREFIX_STATE_TOKENS = 4096
PREFIX_MIN_STATES = 4


def prefix_states(spec: ModelSpec, blocks: int, block_tokens: int) -> int:
    """Recurrent-state snapshots a prefix cache of `blocks` blocks keeps: 0 without linear-attention
    layers, else max(PREFIX_MIN_STATES, ceil(blocks * block_tokens / PREFIX_STATE_TOKENS))."""
    if not spec.linear_layers or blocks < 1:
        return 0
    return max(PREFIX_MIN_STATES, -(-blocks * block_tokens // PREFIX_STATE_TOKENS))


def prefix_state_bytes(spec: ModelSpec) -> int:
    """Bytes of one recurrent-state snapshot: every linear-attention layer's state of one sequence."""
    return recurrent_state_bytes(spec, 1)


def prefix_cache_bytes(spec: ModelSpec, blocks: int, block_tokens: int) -> int:
    """Device memory of a prefix cache of `blocks` blocks: theirs and their state snapshots'."""
    if blocks < 1:
        return 0
    return (blocks * prefix_block_bytes(spec, block_tokens)
            + prefix_states(spec, blocks, block_tokens) * prefix_state_bytes(spec))


def prefix_blocks_for(spec: ModelSpec, kv_cache_gb: float, block_tokens: int, max_seq_len: int) -> int:
    """The most prefix-cache blocks whose prefix_cache_bytes (with a linear-attention model's state
    snapshots) fit in --kv-cache-gb GiB. Raises ValueError naming --kv-cache-gb when it is not > 0 or
    holds no block, or where check_prefix_cache refuses the model."""
    if isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, (int, float)) or not kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0 (GiB of kept prompt prefixes), got {kv_cache_gb!r}")
    check_prefix_cache(spec, block_tokens, max_seq_len)
    budget = int(kv_cache_gb * GIB)
    per = prefix_block_bytes(spec, block_tokens)
    share = prefix_state_bytes(spec) * block_tokens / PREFIX_STATE_TOKENS if spec.linear_layers else 0
    blocks = int(budget // (per + share))
    while blocks > 0 and prefix_cache_bytes(spec, blocks, block_tokens) > budget:
        blocks -= 1  # the snapshots' floor of PREFIX_MIN_STATES and their rounding up
    if blocks < 1:
        least = prefix_cache_bytes(spec, 1, block_tokens)
        states = (f" and {PREFIX_MIN_STATES} snapshots of the linear-attention state, "
                  f"{prefix_state_bytes(spec):,} bytes each" if spec.linear_layers else "")
        raise ValueError(f"--kv-cache-gb {kv_cache_gb:g} holds no prefix block ({per:,} bytes: {block_tokens} tokens "
                         f"of k, v in {counted(len(spec.full_layers), 'layer')}{states}); raise it to at least "
                         f"{gib_at_least(least)}")
    return blocks


def context_bytes(spec: ModelSpec, max_batch: int, max_seq_len: int) -> int:
    """The per-request device memory: the KV cache plus the recurrent state."""
    return kv_cache_bytes(spec, max_batch, max_seq_len) + recurrent_state_bytes(spec, max_batch)


def memory_split(budget: SlotBudget, spec: ModelSpec, max_batch: int, max_seq_len: int, prefix_blocks: int = 0,
                 prefix_block_tokens: int = PREFIX_BLOCK_TOKENS, scratch_slots: int = 0) -> str:
    """One line: the device memory of the expert slots (and of `scratch_slots` beside them: a hybrid split's
    tail slot), of the KV cache (and of a model's linear-attention recurrent state, and of the prefix
    cache's blocks), and their sum."""
    kv = kv_cache_bytes(spec, max_batch, max_seq_len)
    state = recurrent_state_bytes(spec, max_batch)
    kept = prefix_cache_bytes(spec, prefix_blocks, prefix_block_tokens)
    states = prefix_states(spec, prefix_blocks, prefix_block_tokens)
    snapshots = f" and {counted(states, 'linear-attention state snapshot')}" if states else ""
    prefix = "" if not kept else (f" + prefix cache {kept / GIB:.3g} GiB ({counted(prefix_blocks, 'block')} of "
                                  f"{prefix_block_tokens} tokens{snapshots}: --kv-cache-gb)")
    rings = [i for i in spec.full_layers if cache_positions(spec, i, max_seq_len) < max_seq_len]
    whole = len(spec.full_layers) - len(rings)  # the layers that hold every position
    per_token = 2 * whole * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[spec.moe.dtype]
    source = f"--moe-cache-gb {budget.cache_gb:g}" if budget.cache_gb is not None else f"--moe-slots {budget.slots}"
    extra = scratch_slots * budget.bytes_per_expert
    scratch = "" if not extra else (f" + {counted(scratch_slots, 'scratch slot')} {extra / GIB:.3g} GiB (the hybrid "
                                    "split's tail: a served expert's rows the GPU computes)")
    holds = "holds its" if len(rings) == 1 else "hold their"
    sliding = f"; {counted(len(rings), 'sliding layer')} {holds} window of {spec.sliding_window} tokens"
    recurrent = "" if not state else (
        f" + linear-attention state {state / GIB:.3g} GiB (--max-batch {max_batch} x {state // max_batch:,} bytes "
        f"a sequence: {counted(len(spec.linear_layers), 'layer')})")
    return (f"device memory for the cache and the context: expert slots {budget.slot_bytes / GIB:.3g} GiB ({source})"
            f"{scratch} + KV cache {kv / GIB:.3g} GiB (--max-batch {max_batch} x --max-seq-len {max_seq_len} tokens x "
            f"{per_token:,} bytes a token: {counted(whole, 'layer')} x k, v x {counted(spec.num_kv_heads, 'head')} "
            f"x {spec.head_dim} x {DTYPE_BYTES[spec.moe.dtype]} bytes"
            f"{sliding if rings else ''})"
            f"{recurrent}{prefix} = "
            f"{(budget.slot_bytes + extra + kv + state + kept) / GIB:.3g} GiB, "
            f"beside the model's dense weights and, on a GPU, prefill's staging ring of {PREFILL_STAGING} experts "
            f"({PREFILL_STAGING * expert_pricing(spec)[1] / GIB:.3g} GiB)")


def expert_pricing(spec: ModelSpec) -> tuple[str, int]:
    """(format, bytes per expert) of the routed experts as the HostStore holds them: the row bytes of
    spec.moe.expert_banks() (MoEConfig.expert_banks). No tensor is read."""
    per_expert = sum(b.row_bytes for b in spec.moe.expert_banks())
    return spec.moe.format.key, per_expert


def resolve_slots(spec: ModelSpec, num_slots: int | None = None, cache_gb: float | None = None, *,
                  max_batch: int = 1, experts: int | None = None) -> SlotBudget:
    """The cache size from exactly one of `num_slots` (--moe-slots) and `cache_gb` (--moe-cache-gb, GiB);
    `experts`: the experts a layer the cache holds keys of (one rank's under expert parallelism; default
    the model's).

    num_slots is passed through when check_slots accepts it. cache_gb gives min(floor(cache_gb * 2**30 / P),
    L * E) slots. Cost: arithmetic. Raises ValueError naming both flags when both or neither are given;
    check_slots' ValueError for num_slots; FormatError (a ValueError) naming --moe-cache-gb for a budget
    that is not a finite number > 0 or holds no expert; ValueError naming --moe-cache-gb when it holds
    fewer than max_batch * top_k experts (with the budget that does), or --max-batch when the model
    itself has fewer routed experts than that.
    """
    if (num_slots is None) == (cache_gb is None):
        given = "both" if num_slots is not None else "neither"
        raise ValueError(f"give exactly one of --moe-slots N (num_slots=) and --moe-cache-gb G (cache_gb=), "
                         f"got {given}")
    fmt, per_expert = expert_pricing(spec)
    cfg = spec.moe
    layers, experts = spec.num_moe_layers, cfg.num_experts if experts is None else experts
    if cache_gb is None:
        check_slots(num_slots, layers, experts, min(cfg.top_k, experts), max_batch)
        return SlotBudget(num_slots, per_expert, fmt, layers, experts)
    fitted = slots_for_bytes(cache_gb, per_expert, f"{fmt} expert of {per_expert:,} bytes "
                                                   f"(H {cfg.hidden}, I {cfg.expert_intermediate})")
    budget = SlotBudget(min(fitted, layers * experts), per_expert, fmt, layers, experts, cache_gb, fitted)
    top_k = min(cfg.top_k, experts)  # the most of one row's experts a cache of `experts` a layer is asked for
    need = max_batch * top_k
    if budget.slots < need and fitted < need:
        raise ValueError(f"--moe-cache-gb {cache_gb:g} holds {counted(fitted, f'{fmt} expert')} of {per_expert:,} "
                         f"bytes, below --max-batch {max_batch} x top_k {top_k} = {need}: one decode step could "
                         f"route to more distinct experts than slots; give --moe-cache-gb "
                         f"{gib_at_least(need * per_expert)} or more, or lower --max-batch")
    if budget.slots < need:
        raise ValueError(_too_many_rows(max_batch, top_k, budget.keys))
    return budget


def _too_many_rows(max_batch: int, top_k: int, keys: int) -> str:
    return (f"--max-batch {max_batch} x top_k {top_k} = {max_batch * top_k} is above the model's "
            f"{counted(keys, 'routed expert')}, the most slots a cache can have (it needs --max-batch x top_k); "
            f"lower --max-batch to {max(1, keys // top_k)} or less")


def check_slots(num_slots: int, layers: int, experts: int, top_k: int, max_batch: int) -> None:
    """Refuse --moe-slots N (num_slots) outside [--max-batch x top_k, L x E]: below, one decode step could
    route to more distinct experts than slots; above, a slot would never hold an expert. Raises
    ValueError naming the flags and the value that fits."""
    keys, need = layers * experts, max_batch * top_k
    if need > keys:
        raise ValueError(_too_many_rows(max_batch, top_k, keys))
    if num_slots < need:
        raise ValueError(f"--moe-slots {num_slots} is below --max-batch {max_batch} x top_k {top_k} = {need}: one "
                         f"decode step could route to more distinct experts than slots; raise --moe-slots to "
                         f"{need} or more, or lower --max-batch")
    if num_slots > keys:
        raise ValueError(f"--moe-slots {num_slots} is above the model's {counted(keys, 'routed expert')} "
                         f"({counted(layers, 'MoE layer')} x {experts}): a slot beyond them never holds one; pass "
                         f"--moe-slots {keys} to keep every expert resident")
