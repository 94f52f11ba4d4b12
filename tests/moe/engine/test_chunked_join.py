"""A prompt joining chunk by chunk (Engine.start_join / advance) while other rows decode, on the CPU.

    rows 0..B-1 decode a step between each of the joining prompt's prefill chunks (in the spare row,
    the last) -> the joining row's first logits and every row's greedy tokens are those of joining the
    prompt at once; the last chunk moves it into row B (KV, rings, recurrent state); with a prefix cache
    it restores first and saves its blocks as join does; the options and the spare row are checked.
"""

from __future__ import annotations

import pytest
import torch

from moe.engine.backends import make_backend
from moe.engine.engine import Engine
from moe.engine.loading import load_model
from tests.moe.families import assert_near, random_tokens

CHUNK = 8
BLOCK = 4


def _engine(path, max_batch: int = 3, **kw) -> Engine:
    weights = load_model(path, "cpu", num_slots=12, max_batch=max_batch, max_seq_len=96, progress=False).weights
    return Engine(weights, make_backend(weights, 12, "lru", max_batch=max_batch), max_batch=max_batch,
                  max_seq_len=96, prefill_chunk=CHUNK, **kw)


def _decode(engine: Engine, tokens: list[int]) -> list[int]:
    return engine.decode_step(tokens).argmax(dim=-1).tolist()


def _run(engine: Engine, chunked: bool) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor]]:
    """Row 0 decodes; a 30-token prompt joins (4 chunks of 8; chunked: a decode step of row 0 after
    each of its chunks but the last, else those steps before it joins at once); then both decode 5
    steps. Every row's tokens, the joining prompt's first logits, every decode step's logits."""
    a, b = random_tokens(11, seed=21), random_tokens(30, seed=22)
    seqs = [[int(engine.join(a)[1].argmax())]]
    steps = []

    def step():
        logits = engine.decode_step([s[-1] for s in seqs])
        steps.append(logits)
        for s, t in zip(seqs, logits.argmax(dim=-1).tolist()):
            s.append(t)

    if chunked:
        joining = engine.start_join(b)
        assert engine.joining is joining
        while (done := engine.advance(joining)) is None:
            step()
        row, first = done
    else:
        for _ in range(3):
            step()
        row, first = engine.join(b)
    assert row == 1 and engine.batch == 2 and engine.joining is None and engine.lengths()[1] == 30
    seqs.append([int(first.argmax())])
    for _ in range(5):
        step()
    return seqs, first, steps


def test_a_prompt_joined_in_chunks_decodes_as_one_joined_at_once(checkpoint):
    _, _, path = checkpoint
    want_seqs, want_first, want_steps = _run(_engine(path), chunked=False)
    got_seqs, got_first, got_steps = _run(_engine(path), chunked=True)
    assert got_seqs == want_seqs
    assert_near(got_first[None], want_first[None], rel=1e-4)
    for g, w in zip(got_steps, want_steps):
        assert_near(g, w, rel=1e-4)


def test_the_spare_row_is_the_joining_rows_until_it_moves(checkpoint):
    """max_batch 2: row 0 decodes, the spare row 1 joins in place (no move); with max_batch 1 the only row
    is the spare one; join waits for the spare row, and prefill refuses while a prompt joins."""
    _, _, path = checkpoint
    engine = _engine(path, max_batch=2)
    tok = int(engine.join(random_tokens(5, seed=31))[1].argmax())
    joining = engine.start_join(random_tokens(20, seed=32))
    assert joining.row == 1
    with pytest.raises(ValueError, match="max_batch=2 rows are in use .one of them by the prompt joining"):
        engine.join(random_tokens(3, seed=33))
    with pytest.raises(ValueError, match="already joining"):
        engine.start_join(random_tokens(3, seed=33))
    with pytest.raises(ValueError, match="still joining"):
        engine.prefill([random_tokens(3, seed=33)])
    assert int(engine.kv.lengths[0]) == 5 and engine.lengths() == [5]  # the refusal changed nothing
    _decode(engine, [tok])
    while (done := engine.advance(joining)) is None:
        pass
    assert done[0] == 1 and engine.batch == 2 and engine.lengths() == [6, 20]
    with pytest.raises(ValueError, match="not the prompt joining now"):
        engine.advance(joining)
    single = _engine(path, max_batch=1)
    j = single.start_join(random_tokens(17, seed=34))
    while (done := single.advance(j)) is None:
        pass
    want = _engine(path, max_batch=1).join(random_tokens(17, seed=34))[1]
    assert done[0] == 0 and single.batch == 1
    assert_near(done[1][None], want[None], rel=1e-4)
    with pytest.raises(ValueError, match="all max_batch=1 rows are in use"):
        single.start_join(random_tokens(3, seed=35))


def test_an_aborted_join_leaves_the_rows_and_the_spare_row_usable(checkpoint):
    _, _, path = checkpoint
    engine, plain = _engine(path), _engine(path)
    a = random_tokens(9, seed=41)
    tok = int(engine.join(a)[1].argmax())
    joining = engine.start_join(random_tokens(25, seed=42))
    engine.advance(joining)
    engine.abort_join(joining)
    assert engine.joining is None and engine.batch == 1
    with pytest.raises(ValueError, match="not the prompt joining now"):
        engine.advance(joining)
    b = random_tokens(12, seed=43)
    row, got = engine.join(b)
    plain.join(a)
    assert row == 1 and torch.equal(got.argmax(), plain.join(b)[1].argmax())
    assert _decode(engine, [tok, int(got.argmax())]) == _decode(plain, [tok, int(got.argmax())])


def test_a_bad_prompt_is_refused_before_the_spare_row_is_taken(checkpoint):
    _, _, path = checkpoint
    engine = _engine(path)
    with pytest.raises(ValueError, match="vocab_size"):
        engine.start_join([1, 2, 10**6])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.start_join([1] * 97)
    assert engine.joining is None and engine.start_join([1, 2, 3]) is engine.joining


def test_a_chunked_join_restores_and_saves_prefixes(checkpoint):
    """With a prefix cache: the joining prompt restores the kept prefix (Qwen3-Next: up to a block with
    its state) and saves its own blocks, so a later prompt resending it restores them."""
    _, _, path = checkpoint
    kw = dict(prefix_blocks=64, prefix_block_tokens=BLOCK)
    kept, plain = _engine(path, **kw), _engine(path)
    base = random_tokens(21, seed=51)
    for engine in (kept, plain):
        engine.join(base)
        engine.leave(0)
    longer = base + random_tokens(14, seed=52)
    got, cached = {}, {}
    for engine in (kept, plain):
        joining = engine.start_join(longer)
        while (done := engine.advance(joining)) is None:
            pass
        got[engine is kept], cached[engine is kept] = done[1], engine.cached_tokens(done[0])
        engine.leave(0)
    assert cached == {True: 20, False: 0}  # base's 5 whole blocks (and, Qwen3-Next, its state at 20)
    assert_near(got[True][None], got[False][None], rel=1e-4)
    resent = longer + random_tokens(3, seed=53)
    row, again = kept.join(resent)
    assert kept.cached_tokens(row) == 32  # the chunked join saved blocks through position 32 (8 whole blocks)
    assert_near(again[None], plain.join(resent)[1][None], rel=1e-4)


@pytest.mark.gpu
def test_gpu_chunked_join_beside_graph_decode(checkpoint):
    """On a GPU: the rows' decode steps replay CUDA graphs between the joining prompt's chunks; the
    tokens and logits are those of joining it at once."""
    _, _, path = checkpoint

    def engine():
        weights = load_model(path, "cuda", num_slots=12, max_batch=3, max_seq_len=96, progress=False).weights
        return Engine(weights, make_backend(weights, 12, "lru", max_batch=3), max_batch=3, max_seq_len=96,
                      prefill_chunk=CHUNK)

    want_seqs, want_first, want_steps = _run(engine(), chunked=False)
    got_seqs, got_first, got_steps = _run(engine(), chunked=True)
    assert got_seqs == want_seqs
    assert_near(got_first[None].cpu(), want_first[None].cpu(), rel=1e-4)
    for g, w in zip(got_steps, want_steps):
        assert_near(g.cpu(), w.cpu(), rel=1e-4)
