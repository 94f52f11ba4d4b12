"""PrefillStaging: which copy goes to which ring slot, which prefetched copies a layer uses or drops, and
prefill streamed through the ring against prefill reading each expert as it computes it (bitwise, the
cache untouched, transformers within 1e-4). On a GPU with its real copy stream and events; on the CPU
torch.cuda's streams and events are stood in for by no-ops (a CPU copy is done when it returns), so
what runs there is the host's order of copies, reads and releases."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe.engine import backends
from moe.engine.loading import load_model
from tests.moe.families import assert_near, hf_logits, num_experts, random_tokens


class _Event:
    def record(self, stream=None) -> None:
        pass


class _Stream:
    def __init__(self, device=None) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def device(monkeypatch) -> torch.device:
    """CUDA with its streams where there is a GPU, else the CPU with streams and events stood in."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    return torch.device("cpu")


def _snapshot(moe):
    return (moe.slots.cache if hasattr(moe, "slots") else moe.cache).snapshot()


@pytest.mark.parametrize("ring", [1, 2, 3, 5, 64])
def test_the_ring_serves_each_key_its_bytes_and_drops_what_no_layer_reads(checkpoint, device, ring):
    """A prefetch of keys [1, 3, 4, 6, 9] (the ring holds the first `ring` copies), then a layer needing
    [3, 5, 6, 7]: 1 is dropped, 3 used where it was copied, 4 dropped, 5 not prefetched (it, 6 and 7
    copied afresh, the prefetched 6 and 9 dropped); then a layer with no prefetch. Each served slot holds
    the store's bytes of its key."""
    name, model, path = checkpoint
    engine = load_model(path, device.type, num_slots=model.config.num_experts_per_tok, max_seq_len=16,
                        progress=False, cuda_graphs=False)
    store = engine.moe.store
    staging = backends.PrefillStaging(store, ring, device)
    staging.prefetch([1, 3, 4, 6, 9])
    issued = min(ring, 5)  # the ring's slots take the first prefetched keys at once
    assert staging.issued == issued
    used = int(ring >= 2)  # 3, where the ring reached it; 1, 4 and the later prefetched copies are dropped
    for keys in ([3, 5, 6, 7], [0, 2, 8]):
        layer = staging.layer(keys)
        assert staging.prefetched_unused == issued - used
        for j, key in enumerate(keys):
            r = layer.slot(j)
            layer.wait(j)
            assert 0 <= r < ring
            for bank in store.banks:
                got = staging.pool.tensor(bank.name)[r].clone()  # read on the current stream, after the copy
                assert torch.equal(got.cpu(), store.tensor(bank.name)[key]), (keys, key, bank.name)
            layer.release([j])
    assert staging.issued == issued + (4 - used) + 3  # a used prefetched copy is not copied again
    assert len(staging.freed) <= ring  # each slot's last release waits for the next copy into it, no more


def _direct_and_staged(path, k: int, device: torch.device, ring: int):
    """Two engines of the checkpoint (k + 1 slots): one reading each streamed expert as it computes it, one
    streaming through a PrefillStaging ring of `ring` slots (on the CPU too, whose backend has none)."""
    direct, staged = (load_model(path, device.type, num_slots=k + 1, max_seq_len=128, progress=False,
                                 cuda_graphs=False) for _ in range(2))
    moe = staged.moe
    direct.moe.staging = None
    moe.staging = backends.PrefillStaging(moe.store, ring, device)
    if device.type == "cpu":  # the CPU backend reads through moe_prefill without a ring: give it one
        moe.prefill = lambda w, hidden: backends.moe_prefill(moe.store, moe.cfg, w, hidden,
                                                             (torch.from_numpy(moe.cache.slot_of), moe.pool),
                                                             moe.prefill_counts, moe.staging)
    return direct, staged


@pytest.mark.parametrize("ring", [1, 3, 64])
def test_prefill_through_the_ring_is_bitwise_the_direct_reads(checkpoint, device, ring):
    """A prompt using every expert (prefetching the next layer's), a short one (no prefetch) and one
    between, after decode steps that made some experts resident: logits and KV bitwise, the cache
    untouched, the same counts, transformers within 1e-4."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engines = direct, staged = _direct_and_staged(path, k, device, ring)
    moe = staged.moe
    for engine in engines:
        engine.generate([random_tokens(5, seed=6)], max_new_tokens=4)
    before = _snapshot(moe)
    assert 3 * k < backends.PREFETCH_MIN_USES * num_experts(model.config) <= 120 * k
    for prompt in (random_tokens(120, seed=7), random_tokens(3, seed=9), random_tokens(40, seed=4)):
        want, got = (engine.prefill([prompt], all_logits=True)[0] for engine in engines)
        assert torch.equal(got, want)
        assert_near(got.cpu(), hf_logits(model, prompt).logits[0], rel=1e-4)
    for a, b in zip(direct.context_state(), staged.context_state(), strict=True):
        assert torch.equal(a, b)
    assert _snapshot(moe).equals(before)
    assert moe.prefill_counts == direct.moe.prefill_counts
    assert moe.staging.issued == moe.prefill_counts[0] + moe.staging.prefetched_unused
    assert ring == 64 or moe.staging.issued > ring  # the small rings wrap


def test_the_pair_buffer_sum_is_bitwise_the_expert_by_expert_sum(checkpoint, device, monkeypatch):
    """A layer's pair outputs written to a buffer and added column by column (PAIR_BYTES above the prompt's
    [T * k, H]) against each expert's rows added in turn (PAIR_BYTES 0): the same logits and KV bit for bit,
    for a prompt using every expert and a short one, through the ring and through direct reads."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    runs, paths = [], []
    real = backends.out_group
    monkeypatch.setattr(backends, "out_group", lambda *a: paths.append(a[-1] is not None) or real(*a))
    for limit in (1 << 30, 0):
        monkeypatch.setattr(backends, "PAIR_BYTES", limit)
        engines = _direct_and_staged(path, k, device, 3)
        runs.append([engine.prefill([p], all_logits=True)[0] for engine in engines
                     for p in (random_tokens(120, seed=7), random_tokens(5, seed=8))]
                    + [t for engine in engines for t in engine.context_state()])
        assert set(paths) == {limit > 0}  # every group went the way PAIR_BYTES says
        paths.clear()
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [1, 3, 8])
def test_prefill_groups_are_consecutive_bounded_and_pad_at_most_twice(seed, size):
    g = torch.Generator().manual_seed(seed)
    per = (torch.randint(0, 40, (64,), generator=g) * (torch.rand(64, generator=g) < 0.8)).tolist()
    per[5] = 900  # a hot expert
    used = [e for e in range(64) if per[e]]
    groups = backends.prefill_groups(used, per, size)
    assert [e for _, grp in groups for e in grp] == used
    for u0, grp in groups:
        assert used[u0:u0 + len(grp)] == grp and 1 <= len(grp) <= size
        assert len(grp) == 1 or len(grp) * max(per[e] for e in grp) <= 2 * sum(per[e] for e in grp)
    assert [len(grp) <= 2 for _, grp in groups if 5 in grp] == [True]  # the hot one pads at most one other


@pytest.mark.parametrize("seed", range(3))
def test_a_group_adds_each_experts_gated_mlp_as_moe_reference_does(seed):
    """out_group over padded, batched GEMMs against expert_mlp per expert (float32, tolerance of the
    GEMM's summation order), and bit for bit the same on a second run (deterministic)."""
    from moe.model.reference import expert_mlp

    g = torch.Generator().manual_seed(seed)
    T, H, I, E, k = 37, 64, 48, 6, 2
    hidden = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # k distinct a token
    gates = torch.rand(T, k, generator=g)
    w_gu, w_dn = torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 7
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_dev = torch.bincount(flat, minlength=E)
    per = per_dev.tolist()
    flat_sorted = flat[order]
    rank = torch.arange(flat.numel()) - (torch.cumsum(per_dev, 0) - per_dev)[flat_sorted]
    used_at = (torch.cumsum(per_dev > 0, 0) - 1)[flat_sorted]
    rows_all, weight_all = order // k, gates.reshape(-1)[order].unsqueeze(1)
    used = [e for e in range(E) if per[e]]
    starts = [0]
    for n in per:
        starts.append(starts[-1] + n)

    def run():
        out = torch.zeros(T, H)
        for u0, grp in backends.prefill_groups(used, per, 4):
            backends.out_group(out, hidden, w_gu[grp], w_dn[grp], [per[e] for e in grp], starts[grp[0]], u0,
                               rows_all, weight_all, rank, used_at)
        return out

    want = torch.zeros(T, H)
    for e in used:
        rows, cols = torch.nonzero(ids == e, as_tuple=True)
        want.index_add_(0, rows, expert_mlp(hidden[rows], w_gu[e], w_dn[e]) * gates[rows, cols, None])
    got = run()
    assert any(len(grp) > 1 for _, grp in backends.prefill_groups(used, per, 4))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(), got)


def test_a_decode_that_fails_frees_its_ring_slots(checkpoint, device, monkeypatch):
    """A group's decode that raises (out of memory, say) still releases the ring slots it held: the next
    prompt streams through the same ring and gives the direct reads' logits bitwise."""
    _, model, path = checkpoint
    direct, staged = _direct_and_staged(path, model.config.num_experts_per_tok, device, 3)
    real = backends.dequantize_rows_fast

    def failing(rows, dev):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(backends, "dequantize_rows_fast", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        staged.prefill([random_tokens(60, seed=11)])
    monkeypatch.setattr(backends, "dequantize_rows_fast", real)
    prompt = random_tokens(60, seed=12)
    assert torch.equal(staged.prefill([prompt]), direct.prefill([prompt]))


def test_the_raw_copy_addresses_each_banks_row_and_refuses_a_key_out_of_range(checkpoint):
    """_RawRowCopy with a recording stand-in for cuda-python: one cudaMemcpyAsync a bank, from the key's
    row of the store to the slot's row of the pool, on the ring's stream; a key or slot past the end raises
    IndexError before any copy is queued."""
    import types

    name, model, path = checkpoint
    engine = load_model(path, "cpu", num_slots=model.config.num_experts_per_tok, max_seq_len=16, progress=False,
                        cuda_graphs=False)
    store = engine.moe.store
    pool = backends.SlotPool(store.banks, 3, device="cpu")
    calls = []
    success = object()
    cudart = types.SimpleNamespace(
        cudaMemcpyKind=types.SimpleNamespace(cudaMemcpyHostToDevice="h2d"),
        cudaError_t=types.SimpleNamespace(cudaSuccess=success),
        cudaMemcpyAsync=lambda *a: calls.append(a) or (success,))
    raw = backends._RawRowCopy(store, pool, types.SimpleNamespace(cuda_stream=77), cudart)
    raw.copy(store.num_keys - 1, 2)
    want = [(pool.tensor(b.name)[2].data_ptr(), store.tensor(b.name)[store.num_keys - 1].data_ptr(), b.row_bytes,
             "h2d", 77) for b in store.banks]
    assert calls == want
    for key, slot in ((store.num_keys, 0), (0, 3), (-1, 0)):
        with pytest.raises(IndexError, match="out of range"):
            raw.copy(key, slot)
    assert len(calls) == len(store.banks)
    assert backends._RawRowCopy.where_possible(store, pool, None) is None  # a CPU pool: torch's copy_
