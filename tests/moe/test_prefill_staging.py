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
from tests.moe.test_model import _close, _hf_logits, _tokens, checkpoint  # noqa: F401  (the checkpoint fixture)


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
def test_the_ring_serves_each_key_its_bytes_and_drops_what_no_layer_reads(checkpoint, device, ring):  # noqa: F811
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
            assert 0 <= r < ring
            for bank in store.banks:
                got = staging.pool.tensor(bank.name)[r].clone()  # read on the current stream, after the copy
                assert torch.equal(got.cpu(), store.tensor(bank.name)[key]), (keys, key, bank.name)
            layer.release(j)
    assert staging.issued == issued + (4 - used) + 3  # a used prefetched copy is not copied again
    assert len(staging.freed) <= ring  # each slot's last release waits for the next copy into it, no more


@pytest.mark.parametrize("ring", [1, 3, 64])
def test_prefill_through_the_ring_is_bitwise_the_direct_reads(checkpoint, device, ring):  # noqa: F811
    """A prompt using every expert (prefetching the next layer's), a short one (no prefetch) and one
    between, after decode steps that made some experts resident: logits and KV bitwise, the cache
    untouched, the same counts, transformers within 1e-4."""
    name, model, path = checkpoint
    k = model.config.num_experts_per_tok
    engines = [load_model(path, device.type, num_slots=k + 1, max_seq_len=128, progress=False, cuda_graphs=False)
               for _ in range(2)]
    direct, staged = engines
    moe = staged.moe
    direct.moe.staging = None
    moe.staging = backends.PrefillStaging(moe.store, ring, device)
    if device.type == "cpu":  # the CPU backend reads through moe_prefill without a ring: give it one
        moe.prefill = lambda w, hidden: backends.moe_prefill(moe.store, moe.cfg, w, hidden,
                                                             (torch.from_numpy(moe.cache.slot_of), moe.pool),
                                                             moe.prefill_counts, moe.staging)
    for engine in engines:
        engine.generate([_tokens(5, seed=6)], max_new_tokens=4)
    before = _snapshot(moe)
    assert 3 * k < backends.PREFETCH_MIN_USES * model.config.num_experts <= 120 * k
    for prompt in (_tokens(120, seed=7), _tokens(3, seed=9), _tokens(40, seed=4)):
        want, got = (engine.prefill([prompt], all_logits=True)[0] for engine in engines)
        assert torch.equal(got, want)
        _close(got.cpu(), _hf_logits(model, prompt).logits[0], rel=1e-4)
    for a, b in zip(direct.kv.k + direct.kv.v, staged.kv.k + staged.kv.v):
        assert torch.equal(a, b)
    assert _snapshot(moe).equals(before)
    assert moe.prefill_counts == direct.moe.prefill_counts
    assert moe.staging.issued == moe.prefill_counts[0] + moe.staging.prefetched_unused
    assert ring == 64 or moe.staging.issued > ring  # the small rings wrap
