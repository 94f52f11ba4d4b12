"""The prefix cache (moe.engine.prefix) alone and in the engine, on the CPU.

    PrefixCache: chains of token blocks found by content, restored into a row's KV, saved from a prefill
        chunk's k, v or from a row's KV, the least recently used leaf evicted when the pool is full
    Engine(prefix_blocks=...): a multi-turn conversation, each turn resending the last one's prompt and
        answer, against the same engine without a cache: identical greedy tokens, float32 logits within
        1e-4; rows of different restored lengths in one batch; a pool too small for the conversation
        (eviction, blocks reused) changes no token; gpt-oss's sliding rings restored from the blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from moe.engine.attention import KVCache
from moe.engine.linear_attention import RecurrentCache
from moe.engine.loading import load_model
from moe.engine.prefix import ROOT, PrefixCache
from moe.model.spec import ModelSpec
from moe.testing.tiny_checkpoint import randomize
from tests.moe.families import COMMON, FAMILIES, assert_near, random_tokens

BLOCK = 4


def _spec_kv(name: str = "qwen3", max_len: int = 64) -> tuple[ModelSpec, KVCache]:
    config_cls, _, extra = FAMILIES[name]
    spec = ModelSpec.from_hf(config_cls(**{**COMMON, **extra}).to_dict())
    return spec, KVCache(spec, 2, max_len, torch.float32, torch.device("cpu"))


def _fill(cache: PrefixCache, tokens: list[int], parent: int = ROOT, first: int = 0) -> list[int]:
    """Save blocks first.. of tokens as if a prefill chunk computed them (k, v = position + layer)."""
    res = cache.reserve(tokens, parent, first, len(tokens) // BLOCK, keep=set())
    for layer, pool in enumerate(cache.k):
        if pool is not None:
            t = len(tokens)
            k = torch.arange(t, dtype=torch.float32)[:, None, None].expand(t, pool.shape[1], pool.shape[3]) + layer
            cache.write_chunk(res, layer, 0, k, -k)
    return cache.commit(res)


def test_blocks_are_found_by_their_whole_prefix():
    spec, kv = _spec_kv()
    cache = PrefixCache(spec, kv, num_blocks=8, block_tokens=BLOCK)
    a = list(range(10, 22))  # 3 blocks
    ids = _fill(cache, a)
    assert len(ids) == 3 and len(cache) == 3
    assert cache.match(a + [1, 2], limit=13) == ids
    assert cache.match(a, limit=11) == ids[:2]  # the last token is always computed
    assert cache.match([99] + a[1:], limit=11) == []  # block 0 differs: nothing after it is found
    b = a[:4] + [7, 7, 7, 7] + a[8:]
    assert cache.match(b, limit=12) == ids[:1]  # the same third block under another second: not found
    assert cache.follow(a, ids[0], 1, 3) == ids[1:]
    assert cache.stats.restored == (3 + 2 + 0 + 1) * BLOCK and cache.stats.queried == 13 + 11 + 11 + 12


def test_restore_writes_positions_and_rings():
    for name in ("qwen3",):
        spec, kv = _spec_kv(name)
        cache = PrefixCache(spec, kv, num_blocks=8, block_tokens=BLOCK)
        tokens = list(range(12))
        ids = _fill(cache, tokens)
        assert cache.restore(ids, kv, row=1) == 12
        for layer, k in enumerate(kv.k):
            if k is not None:
                want = torch.arange(12, dtype=torch.float32)[None, :, None].expand(k.shape[1], 12, k.shape[3]) + layer
                assert torch.equal(k[1, :, :12], want) and torch.equal(kv.v[layer][1, :, :12], -want)
                assert not k[0].any()  # the other row untouched


def test_the_least_recently_used_leaf_goes_first_and_chains_stay_whole():
    spec, kv = _spec_kv()
    cache = PrefixCache(spec, kv, num_blocks=4, block_tokens=BLOCK)
    a, b = list(range(8)), list(range(50, 58))
    ida, idb = _fill(cache, a), _fill(cache, b)
    cache.match(a, limit=8)  # a touched: b is now the least recently used
    c = list(range(90, 94))
    idc = _fill(cache, c)
    assert cache.stats.evicted == 1 and len(cache) == 4
    assert cache.match(b, limit=8) == idb[:1]  # b's leaf went, its first block (not a leaf then) stayed
    assert cache.match(a, limit=8) == ida and cache.match(c + [0], limit=4) == idc
    old = idb[1]
    assert not cache.alive(old, 0) and cache.generation(old) == 1
    # a full pool whose every block is kept (or an ancestor) reserves nothing
    res = cache.reserve(list(range(200, 204)), ROOT, 0, 1, keep={ida[1], idb[0], idc[0]})
    assert res.ids == []


def test_a_failed_chunk_returns_its_blocks():
    spec, kv = _spec_kv()
    cache = PrefixCache(spec, kv, num_blocks=2, block_tokens=BLOCK)
    res = cache.reserve(list(range(8)), ROOT, 0, 2, keep=set())
    assert len(res.ids) == 2 and len(cache) == 0
    cache.release(res)
    assert cache.match(list(range(8)), limit=8) == [] and len(_fill(cache, list(range(8)))) == 2


def test_options_are_checked_by_name():
    spec, kv = _spec_kv()
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixCache(spec, kv, num_blocks=0)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(spec, kv, num_blocks=4, block_tokens=6)
    nspec, nkv = _spec_kv("qwen3_next")
    with pytest.raises(ValueError, match="num_states"):
        PrefixCache(nspec, nkv, num_blocks=4)
    with pytest.raises(ValueError, match="num_states"):
        PrefixCache(nspec, nkv, num_blocks=4, recurrent=_recurrent(nspec), num_states=0)


def _recurrent(spec: ModelSpec, rows: int = 2) -> RecurrentCache:
    return RecurrentCache(spec.linear, spec.linear_layers, rows, torch.float32, torch.device("cpu"))


def _set_state(rec: RecurrentCache, row: int, value: float) -> None:
    for st in rec.states.values():
        st.conv[row].fill_(value)
        st.delta[row].fill_(-value)


def test_a_linear_attention_chain_resumes_at_its_last_state_snapshot():
    """Qwen3-Next: match stops at the chain's last block holding a state snapshot; restore copies the
    blocks' k, v and that snapshot into the row; the least recently used snapshot is evicted when the
    pool of snapshots is full, and a block's snapshot goes with the block."""
    spec, kv = _spec_kv("qwen3_next")
    rec = _recurrent(spec)
    cache = PrefixCache(spec, kv, num_blocks=4, block_tokens=BLOCK, recurrent=rec, num_states=2)
    a = list(range(10, 22))  # 3 blocks
    ids = _fill(cache, a)
    assert cache.match(a + [1], limit=12) == []  # no snapshot: nothing to resume from
    _set_state(rec, 0, 1.0)
    assert cache.save_state(ids[0], rec, row=0) and cache.has_state(ids[0])
    _set_state(rec, 0, 2.0)
    assert cache.save_state(ids[1], rec, row=0)
    _set_state(rec, 0, 9.0)
    assert not cache.save_state(ids[1], rec, row=0)  # a block keeps the snapshot it has
    assert cache.match(a + [1], limit=12) == ids[:2]  # block 2 has none: the chain ends at block 1
    assert cache.restore(ids[:2], kv, row=1, recurrent=rec) == 2 * BLOCK
    for layer, st in rec.states.items():
        assert (st.conv[1] == 2.0).all() and (st.delta[1] == -2.0).all(), layer
    for layer, k in enumerate(kv.k):
        if k is not None:
            assert torch.equal(k[1, 0, :2 * BLOCK, 0], torch.arange(2 * BLOCK, dtype=torch.float32) + layer)
    # a third snapshot evicts the least recently used one: block 0's (block 1's was just matched)
    _set_state(rec, 0, 3.0)
    assert cache.save_state(ids[2], rec, row=0)
    assert not cache.has_state(ids[0]) and cache.has_state(ids[1]) and cache.has_state(ids[2])
    assert cache.stats.states_written == 3 and cache.stats.states_evicted == 1
    assert cache.match(a + [1], limit=12) == ids
    # a new chain evicts a's leaf (block 2) and its snapshot with it
    b = list(range(40, 48))
    bids = _fill(cache, b)
    assert len(bids) == 2 and not cache.has_state(ids[2]) and len(cache) == 4
    assert cache.match(a + [1], limit=12) == ids[:2]


# ---------------------------------------------------------------- in the engine


def _turns(engine, first: list[int], turns: int, new: int, answer: int) -> tuple[list[list[int]], list, list[int]]:
    """A conversation: each turn's prompt is the last prompt, its answer and `new` fresh tokens; returns
    the answers, each turn's logits (prefill's last and every decode step's) and the restored tokens."""
    prompt, answers, logits, cached = list(first), [], [], []
    for turn in range(turns):
        _, last = engine.join(prompt)
        cached.append(engine.cached_tokens(0))
        out, steps = [int(last.argmax())], [last]
        for _ in range(answer - 1):
            step = engine.decode_step([out[-1]])
            steps.append(step[0])
            out.append(int(step[0].argmax()))
        engine.leave(0)
        answers.append(out)
        logits.append(torch.stack(steps))
        prompt = prompt + out + random_tokens(new, seed=100 + turn)
    return answers, logits, cached


@pytest.mark.parametrize("blocks", [64, 5])
def test_a_conversation_decodes_the_same_with_its_prefix_kept(checkpoint, blocks):
    """Every turn resends the last; with the cache only the new tokens are computed (all but the last
    partial block of what the last turn held), with a pool of 5 blocks the conversation outgrows it."""
    name, _, path = checkpoint
    plain = load_model(path, "cpu", num_slots=8, max_seq_len=96, progress=False)
    kept = load_model(path, "cpu", num_slots=8, max_seq_len=96, progress=False, prefix_blocks=blocks,
                      prefix_block_tokens=BLOCK)
    first = random_tokens(9, seed=7)
    want, want_logits, none = _turns(plain, first, turns=4, new=5, answer=6)
    got, got_logits, cached = _turns(kept, first, turns=4, new=5, answer=6)
    assert got == want and none == [0] * 4
    for g, w in zip(got_logits, want_logits):
        assert_near(g, w, rel=1e-4)
    if blocks == 64:
        # turn t's prompt holds turn t - 1's prompt and answer but the last answer token (never fed back)
        prompts = [9 + t * (6 + 5) for t in range(4)]
        assert cached == [0] + [((p - 6) // BLOCK) * BLOCK for p in prompts[1:]]
        return
    # 5 blocks: the conversation's chain fills the pool by turn 1 (a chain never evicts its own blocks),
    # so later turns restore its first 5 blocks; a second conversation then evicts the first one's leaves
    assert len(kept.prefix) == 5 and cached[1:] == [3 * BLOCK, 5 * BLOCK, 5 * BLOCK]
    other = random_tokens(10, seed=8)
    want, want_logits, _ = _turns(plain, other, turns=3, new=5, answer=6)
    got, got_logits, cached = _turns(kept, other, turns=3, new=5, answer=6)
    assert got == want and kept.prefix.stats.evicted > 0 and len(kept.prefix) == 5 and cached[2] > 0
    for g, w in zip(got_logits, want_logits):
        assert_near(g, w, rel=1e-4)


def test_rows_of_different_restored_lengths_batch_together(checkpoint):
    name, _, path = checkpoint
    kw = dict(num_slots=12, max_batch=3, max_seq_len=64, progress=False)
    plain, kept = load_model(path, "cpu", **kw), load_model(path, "cpu", **kw, prefix_blocks=32,
                                                               prefix_block_tokens=BLOCK)
    base = random_tokens(14, seed=11)
    kept.join(base)  # saves 3 blocks of base
    kept.leave(0)
    prompts = [base + random_tokens(3, seed=12), base[:9] + random_tokens(6, seed=13), random_tokens(7, seed=14)]
    outs = {}
    for engine in (plain, kept):
        tokens = [int(engine.join(p)[1].argmax()) for p in prompts]
        seqs = [[t] for t in tokens]
        for _ in range(5):
            tokens = engine.decode_step(tokens).argmax(dim=-1).tolist()
            for s, t in zip(seqs, tokens):
                s.append(t)
        outs[engine is kept] = seqs
    # Qwen3-Next resumes only at a block with its state: base's prefill saved one at its last block
    # boundary (12), none at 8
    assert [kept.cached_tokens(r) for r in range(3)] == ([12, 0, 0] if name == "qwen3_next" else [12, 8, 0])
    assert outs[True] == outs[False]


def test_a_long_answer_leaves_one_state_snapshot_at_its_end(checkpoint):
    """Qwen3-Next: the prompt's prefill saves the state at its last block boundary; decode saves it at
    each block the row completes but keeps only the latest, so the finished sequence leaves two
    snapshots, and a prompt resending it resumes at the answer's last block boundary."""
    name, _, path = checkpoint
    if name != "qwen3_next":
        pytest.skip("state snapshots are the linear-attention layers'")
    plain, kept = _kept_engine(path), _kept_engine(path, prefix_blocks=64)
    prompt = random_tokens(9, seed=61)
    seqs = {}
    for engine in (plain, kept):
        token = int(engine.join(prompt)[1].argmax())
        seq = prompt + [token]
        for _ in range(20):  # feeds 20 tokens: the row holds 29, blocks end at 12, 16, 20, 24, 28
            token = int(engine.decode_step([token])[0].argmax())
            seq.append(token)
        engine.leave(0)
        seqs[engine is kept] = seq
    assert seqs[True] == seqs[False]
    stats = kept.prefix.stats
    assert stats.states_written == 1 + 5 and kept.prefix.snapshots == 2 and stats.states_evicted == 0
    resent = seqs[True] + random_tokens(4, seed=62)
    got, want = kept.join(resent)[1], plain.join(resent)[1]
    assert kept.cached_tokens(0) == 28
    assert_near(got[None], want[None], rel=1e-4)


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory):
    """gpt-oss alternating a sliding layer (window 8) and a full one, with sinks."""
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
               max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(GptOssConfig(**cfg)).eval()
    randomize(model, seed=3)
    path = tmp_path_factory.mktemp("gpt_oss_window")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gpt_oss_sliding_rings_are_restored_from_the_blocks(gpt_oss_path, device):
    """A resent conversation longer than the window restores each sliding layer's ring from the kept
    blocks (on a GPU: the fused decode then reads and writes the rings the restore filled)."""
    plain = load_model(gpt_oss_path, device, num_slots=4, max_seq_len=96, progress=False)
    kept = load_model(gpt_oss_path, device, num_slots=4, max_seq_len=96, progress=False, prefix_blocks=64,
                      prefix_block_tokens=BLOCK)
    assert kept.kv.ring[0] == 8
    first = random_tokens(13, seed=21)
    want, want_logits, _ = _turns(plain, first, turns=3, new=4, answer=7)
    got, got_logits, cached = _turns(kept, first, turns=3, new=4, answer=7)
    assert got == want and cached[1] > 8 and cached[2] > cached[1]
    for g, w in zip(got_logits, want_logits):
        assert_near(g.cpu(), w.cpu(), rel=1e-4)


def _kept_engine(path, **kw):
    """An Engine over `path`'s weights with a prefix cache of 4-token blocks and the options in kw."""
    from moe.engine.backends import make_backend
    from moe.engine.engine import Engine

    weights = load_model(path, "cpu", num_slots=12, max_batch=3, max_seq_len=96, progress=False).weights
    return Engine(weights, make_backend(weights, 12, "lru", max_batch=3), max_batch=3, max_seq_len=96,
                  prefix_block_tokens=BLOCK, **kw)


def _script(engine) -> tuple[list[list[int]], list[torch.Tensor], list[int], list[int]]:
    """Rows joining, decoding past block boundaries, the middle one leaving (the last moves into its row
    and goes on saving), then two prompts resending what rows 0 and 1 hold; every logit and token, the
    tokens the resent prompts restored, and the tokens rows 0 and 1 held."""
    seqs, logits = [], []

    def step(n: int) -> None:
        for _ in range(n):
            out = engine.decode_step([s[-1] for s in seqs])
            logits.append(out)
            for s, t in zip(seqs, out.argmax(dim=-1).tolist()):
                s.append(t)

    for seed, n in ((31, 9), (32, 6), (33, 11)):
        p = random_tokens(n, seed=seed)
        last = engine.join(p)[1]
        logits.append(last[None])
        seqs.append(p + [int(last.argmax())])
    step(5)
    engine.leave(1)
    seqs[1] = seqs.pop()
    step(6)
    resent = [seqs[0][:-1] + random_tokens(3, seed=40), seqs[1][:-1] + random_tokens(2, seed=41)]
    held = [len(s) - 1 for s in seqs]  # the rows' fed tokens (the last sampled one never fed back)
    for row in reversed(range(engine.batch)):
        engine.leave(row)
    seqs.clear()
    cached = []
    for p in resent:
        last = engine.join(p)[1]
        cached.append(engine.cached_tokens(engine.batch - 1))
        logits.append(last[None])
        seqs.append(p + [int(last.argmax())])
    step(3)
    return seqs, logits, cached, held


@pytest.mark.parametrize("chunk", [16384, 8])
def test_rows_leaving_and_chunked_prompts_keep_the_right_blocks(checkpoint, chunk):
    """The moved row saves its later blocks under its own tokens, and a prompt prefilled in chunks of 8
    saves each chunk's blocks: the resent prompts restore exactly what their rows held (all but the
    last token, whole blocks), with the tokens and logits of the engine without a cache."""
    name, _, path = checkpoint
    want_seqs, want_logits, none, _ = _script(_kept_engine(path, prefill_chunk=chunk))
    kept = _kept_engine(path, prefill_chunk=chunk, prefix_blocks=64)
    seqs, logits, cached, held = _script(kept)
    assert seqs == want_seqs and none == [0, 0]
    for g, w in zip(logits, want_logits):
        assert_near(g, w, rel=1e-4)
    assert cached == [n // BLOCK * BLOCK for n in held] and min(cached) >= 3 * BLOCK


def test_a_join_that_fails_leaves_the_rows_in_step(checkpoint):
    """A prompt with an out-of-range id is refused before any row state changes: later rows save and
    restore their own blocks."""
    name, _, path = checkpoint
    plain, kept = _kept_engine(path), _kept_engine(path, prefix_blocks=64)
    a, b = random_tokens(13, seed=51), random_tokens(13, seed=52)
    with pytest.raises(ValueError, match="vocab_size"):
        kept.join(a[:3] + [10**6])
    for engine in (plain, kept):
        for p in (a, b):
            engine.join(p)
            engine.leave(0)
    resent = a + random_tokens(3, seed=53)
    got, want = kept.join(resent)[1], plain.join(resent)[1]
    assert kept.cached_tokens(0) == 12
    assert_near(got[None], want[None], rel=1e-4)


@pytest.mark.gpu
def test_gpu_conversation_with_its_prefix_kept(checkpoint):
    """The conversation on a GPU (CUDA-graph decode, the fused attention writing the rings the restore
    fills): the same greedy tokens and float32 logits within 1e-4 as without the cache."""
    name, _, path = checkpoint
    plain = load_model(path, "cuda", num_slots=8, max_seq_len=96, progress=False)
    kept = load_model(path, "cuda", num_slots=8, max_seq_len=96, progress=False, prefix_blocks=64,
                      prefix_block_tokens=BLOCK)
    first = random_tokens(9, seed=7)
    want, want_logits, _ = _turns(plain, first, turns=3, new=5, answer=6)
    got, got_logits, cached = _turns(kept, first, turns=3, new=5, answer=6)
    assert got == want and cached[1] > 0
    for g, w in zip(got_logits, want_logits):
        assert_near(g.cpu(), w.cpu(), rel=1e-4)


def test_peek_tells_what_match_would_restore_and_changes_nothing():
    for name in ("qwen3", "qwen3_next"):
        spec, kv = _spec_kv(name)
        extra = dict(recurrent=_recurrent(spec), num_states=2) if spec.linear_layers else {}
        cache = PrefixCache(spec, kv, num_blocks=8, block_tokens=BLOCK, **extra)
        a = list(range(10, 22))
        ids = _fill(cache, a)
        if spec.linear_layers:
            _set_state(extra["recurrent"], 0, 1.0)
            cache.save_state(ids[1], extra["recurrent"], row=0)
        before = (vars(cache.stats).copy(), cache._tick, {b: blk.tick for b, blk in cache._blocks.items()})
        for tokens, limit in ((a + [1], 12), (a, 11), ([99] + a[1:], 11), (a[:4] + [7] * 8, 12)):
            got = cache.peek(tokens, limit)
            assert (vars(cache.stats), cache._tick) == before[:2] and \
                {b: blk.tick for b, blk in cache._blocks.items()} == before[2]
            assert got == len(cache.match(tokens, limit)) * BLOCK, (name, tokens, limit)
            before = (vars(cache.stats).copy(), cache._tick, {b: blk.tick for b, blk in cache._blocks.items()})
