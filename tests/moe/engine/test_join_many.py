"""Several prompts joining in one prefill pass (Engine.join_many), on the CPU, every family.

    row 0 decodes; 3 prompts join at once -> their first logits and every row's greedy tokens are those
    of joining them one by one, with the MoE prefill run once a layer instead of once a prompt; with a
    prefix cache each restores its kept prefix and saves its blocks once (two prompts sharing blocks in
    one pass, a pool small enough that their reservations must spare each other's parents); refusals
    change nothing.
"""

from __future__ import annotations

import pytest
import torch

from moe.engine.backends import make_backend
from moe.engine.engine import Engine
from moe.engine.loading import load_model
from tests.moe.families import assert_near, random_tokens

CHUNK = 32
BLOCK = 4


def _engine(path, **kw) -> Engine:
    weights = load_model(path, "cpu", num_slots=16, max_batch=4, max_seq_len=96, progress=False).weights
    return Engine(weights, make_backend(weights, 16, "lru", max_batch=4), max_batch=4, max_seq_len=96,
                  prefill_chunk=CHUNK, **kw)


def _count_prefills(engine: Engine) -> list[int]:
    """A counter of the MoE backend's prefill calls (one a MoE layer a pass)."""
    calls, prefill = [0], engine.moe.prefill

    def counted(w, hidden):
        calls[0] += 1
        return prefill(w, hidden)

    engine.moe.prefill = counted
    return calls


def _decode(engine: Engine, seqs: list[list[int]], steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        logits = engine.decode_step([s[-1] for s in seqs])
        out.append(logits)
        for s, t in zip(seqs, logits.argmax(dim=-1).tolist()):
            s.append(t)
    return out


def _moe_layers(engine: Engine) -> int:
    return sum(type(lw.mlp).__name__ == "MoEWeights" for lw in engine.weights.layers)


def test_prompts_joined_in_one_pass_decode_as_joined_one_by_one(checkpoint):
    _, _, path = checkpoint
    a = random_tokens(7, seed=61)
    prompts = [random_tokens(n, seed=62 + n) for n in (5, 9, 12)]
    results = {}
    for together in (False, True):
        engine = _engine(path)
        seqs = [[int(engine.join(a)[1].argmax())]]
        calls = _count_prefills(engine)
        joined = engine.join_many(prompts) if together else [engine.join(p) for p in prompts]
        assert [row for row, _ in joined] == [1, 2, 3] and engine.lengths() == [7, 5, 9, 12]
        assert calls[0] == _moe_layers(engine) * (1 if together else 3)
        first = torch.stack([logits for _, logits in joined])
        seqs += [[int(t)] for t in first.argmax(dim=-1)]
        results[together] = (first, seqs, _decode(engine, seqs, 4))
    (want_first, want_seqs, want_steps), (got_first, got_seqs, got_steps) = results[False], results[True]
    assert got_seqs == want_seqs
    assert_near(got_first, want_first, rel=1e-4)
    for g, w in zip(got_steps, want_steps):
        assert_near(g, w, rel=1e-4)


@pytest.mark.parametrize("blocks", [64, 6])
def test_a_pass_restores_and_saves_prefixes_once(checkpoint, blocks):
    """base (12 tokens, 3 blocks) is kept; then base + x twice (sharing x's blocks within the pass) and a
    new prompt join at once. 64 blocks: each restores base, x's 2 blocks are written once, and a later
    prompt resending base + x restores all 5. 6 blocks: the new prompt's reservation may evict only
    leaves no other row of the pass hangs its blocks from. Qwen3-Next, whose prefix cache keeps states,
    joins them one by one. Tokens as without a cache, and every pool block either free or kept."""
    name, _, path = checkpoint
    base, x, y = random_tokens(12, seed=71), random_tokens(9, seed=72), random_tokens(13, seed=73)
    kept, plain = _engine(path, prefix_blocks=blocks, prefix_block_tokens=BLOCK), _engine(path)
    kept.join(base)
    kept.leave(0)
    prompts = [base + x, base + x, y]
    got = kept.join_many(prompts)
    if blocks == 64:  # the second base + x chains through the x blocks the first wrote, and saves as it decodes
        assert kept._rows[1].chain[0] == kept._rows[0].chain[0] == 5
    want = [plain.join(p) for p in prompts]
    # one by one, the second base + x restores x's blocks the first saved
    assert [kept.cached_tokens(r) for r in range(3)] == ([12, 20, 0] if name == "qwen3_next" else [12, 12, 0])
    prefix = kept.prefix
    if blocks == 64 and name != "qwen3_next":
        assert prefix.stats.written == 3 + 2 + 3  # base, x's whole blocks once, y's 3
    for (_, g), (_, w) in zip(got, want):
        assert int(g.argmax()) == int(w.argmax())
        assert_near(g[None], w[None], rel=1e-4)
    seqs = [[int(g.argmax())] for _, g in got]
    assert seqs == [[int(w.argmax())] for _, w in want]
    got_steps, want_steps = _decode(kept, [list(s) for s in seqs], 3), _decode(plain, [list(s) for s in seqs], 3)
    assert [s.argmax(dim=-1).tolist() for s in got_steps] == [s.argmax(dim=-1).tolist() for s in want_steps]
    assert len(prefix) + len(prefix._free) == blocks
    if blocks == 64:
        for _ in range(3):
            kept.leave(0)
        kept.join(base + x + [5, 6])
        assert kept.cached_tokens(0) == 20


def test_refusals_name_the_limit_and_change_nothing(checkpoint):
    _, _, path = checkpoint
    engine = _engine(path, prefix_blocks=16, prefix_block_tokens=BLOCK)
    engine.join(random_tokens(6, seed=81))
    free = len(engine.prefix._free)
    for prompts, match in (([random_tokens(3, seed=s) for s in range(4)], "4 prompts do not fit the 3 free rows"),
                           ([random_tokens(20, seed=1), random_tokens(13, seed=2)], "compute 33 tokens together"),
                           ([random_tokens(3, seed=1), [1, 2, 10**6]], "vocab_size"),
                           ([random_tokens(3, seed=1), []], "empty prompt"),
                           ([], "no prompts")):
        with pytest.raises(ValueError, match=match):
            engine.join_many(prompts)
        assert engine.batch == 1 and engine.lengths() == [6] and len(engine.prefix._free) == free
    joining = engine.start_join(random_tokens(40, seed=82))
    with pytest.raises(ValueError, match="free rows of max_batch=4 .one of them by the prompt joining"):
        engine.join_many([random_tokens(3, seed=s) for s in range(3)])
    engine.abort_join(joining)
    rows = engine.join_many([random_tokens(3, seed=s) for s in range(3)])
    assert [row for row, _ in rows] == [1, 2, 3] and engine.batch == 4


def test_a_pass_that_fails_returns_its_blocks_and_adds_no_row(checkpoint, monkeypatch):
    name, _, path = checkpoint
    engine = _engine(path, prefix_blocks=16, prefix_block_tokens=BLOCK)
    engine.join(random_tokens(6, seed=91))
    free = len(engine.prefix._free)
    monkeypatch.setattr(engine, "_logits", lambda x: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.join_many([random_tokens(9, seed=92), random_tokens(13, seed=93)])
    assert engine.batch == 1 and engine.lengths() == [6]
    # Qwen3-Next's prompts join one by one: the first one's blocks stay kept, as a join of it alone keeps them
    assert len(engine.prefix._free) == free or name == "qwen3_next"
    assert len(engine.prefix) + len(engine.prefix._free) == 16


def test_prefill_of_several_prompts_is_one_pass_where_they_fit_a_chunk(checkpoint):
    """Engine.prefill: prompts of at most a chunk together go through one pass, the same greedy tokens and
    float32 logits to rounding as one by one; more than a chunk, all_logits, or a prefix cache (where a
    prompt restores what an earlier one of the batch kept), one by one."""
    name, _, path = checkpoint
    prompts = [random_tokens(n, seed=80 + n) for n in (6, 11, 14)]  # 31 tokens: one chunk of 32
    one = _engine(path)
    want = torch.stack([one.prefill([p])[0] for p in prompts])
    engine = _engine(path)
    calls = _count_prefills(engine)
    got = engine.prefill(prompts)
    assert calls[0] == _moe_layers(engine) and engine.lengths() == [6, 11, 14]
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
    assert_near(got, want, rel=1e-4)
    steps = _decode(engine, [[int(t)] for t in got.argmax(dim=-1)], 2)
    assert all(s.shape == (3, got.shape[1]) for s in steps)
    for over, kw in ((prompts + [random_tokens(2, seed=90)], {}), (prompts, {"all_logits": True})):
        calls[0] = 0
        engine.prefill(over, **kw)
        assert calls[0] == _moe_layers(engine) * len(over)
    kept = _engine(path, prefix_blocks=64, prefix_block_tokens=BLOCK)
    calls = _count_prefills(kept)
    shared = random_tokens(8, seed=91)
    kept.prefill([shared + prompts[0][:4], shared + prompts[1][:4]])
    assert calls[0] == _moe_layers(kept) * 2
    # Qwen3-Next keeps the first prompt's state at its end (12 tokens) only, past the 8 the second shares
    assert kept.cached_tokens(1) == (0 if name == "qwen3_next" else 8)
