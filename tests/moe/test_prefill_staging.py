"""PrefillStaging's bookkeeping on the CPU: which copy goes to which ring slot, which prefetched copies a
layer uses or drops, and prefill streamed through the ring against prefill reading each expert as it
computes it (bitwise). torch.cuda's streams and events are stood in for by no-ops (a CPU copy is done
when it returns), so what runs is the host's order of copies, reads and releases; the same tests with
real streams are the GPU tests in tests/moe/test_model.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe.engine import backends
from moe.engine.loading import load_model
from tests.moe.test_model import _tokens, checkpoint  # noqa: F401  (the module-scoped checkpoint fixture)


class _Event:
    def record(self, stream=None) -> None:
        pass


class _Stream:
    def __init__(self, device=None) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


@pytest.fixture
def host_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())


@pytest.mark.parametrize("ring", [1, 2, 3, 5, 64])
def test_the_ring_serves_each_key_its_bytes_and_drops_what_no_layer_reads(checkpoint, host_streams, ring):  # noqa: F811
    name, model, path = checkpoint
    engine = load_model(path, "cpu", num_slots=model.config.num_experts_per_tok, max_seq_len=16, progress=False)
    store = engine.moe.store
    staging = backends.PrefillStaging(store, ring, torch.device("cpu"))
    staging.prefetch([1, 3, 4, 6, 9])
    issued = min(ring, 5)  # the ring's slots take the first prefetched keys at once
    assert staging.issued == issued
    used = int(ring >= 2)  # 3, where the ring reached it; 1, 4 and the later prefetched copies are dropped
    for keys in ([3, 5, 6, 7], [0, 2, 8]):
        layer = staging.layer(keys)
        assert staging.prefetched_unused == issued - used
        for j, key in enumerate(keys):
            r = layer.slot(j)
            assert 0 <= r < ring
            for bank in store.banks:
                assert torch.equal(staging.pool.tensor(bank.name)[r], store.tensor(bank.name)[key]), (keys, key)
            layer.release(j)
    assert staging.issued == issued + (4 - used) + 3  # a used prefetched copy is not copied again
    assert len(staging.freed) <= ring  # each slot's last release waits for the next copy into it, no more


@pytest.mark.parametrize("ring", [1, 3, 64])
def test_prefill_through_the_ring_is_bitwise_the_direct_reads(checkpoint, host_streams, ring):  # noqa: F811
    """A prompt using every expert (prefetching the next layer's), a short one (no prefetch) and one
    between, after decode steps that made some experts resident."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engines = [load_model(path, "cpu", num_slots=k + 1, max_seq_len=128, progress=False) for _ in range(2)]
    direct, staged = engines
    moe = staged.moe
    moe.staging = backends.PrefillStaging(moe.store, ring, torch.device("cpu"))
    moe.prefill = lambda w, hidden: backends.moe_prefill(moe.store, moe.cfg, w, hidden,
                                                         (torch.from_numpy(moe.cache.slot_of), moe.pool),
                                                         moe.prefill_counts, moe.staging)
    for engine in engines:
        engine.generate([_tokens(5, seed=6)], max_new_tokens=4)
    assert 3 * k < backends.PREFETCH_MIN_USES * model.config.num_experts <= 120 * k
    for prompt in (_tokens(120, seed=7), _tokens(3, seed=9), _tokens(40, seed=4)):
        want, got = (engine.prefill([prompt], all_logits=True)[0] for engine in engines)
        assert torch.equal(got, want)
    assert moe.prefill_counts == direct.moe.prefill_counts
    assert moe.staging.issued == moe.prefill_counts[0] + moe.staging.prefetched_unused
    assert ring == 64 or moe.staging.issued > ring  # the small rings wrap
