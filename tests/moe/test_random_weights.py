"""moe.testing.synthetic.random_weights: experts drawn in chunks the device holds."""

from __future__ import annotations

import pytest
import torch

import moe.testing.synthetic as synthetic
from moe.model.config import MoEConfig


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_large_experts_are_drawn_in_fewer_a_chunk(monkeypatch, fmt):
    """Where CHUNK_EXPERTS experts' float32 draws would pass CHUNK_BYTES, a chunk holds fewer (here 3 of 8
    experts): every expert is still written once, never zero, and a seed gives the same store again."""
    cfg = MoEConfig(hidden=64, num_experts=4, top_k=2, expert_intermediate=48, expert_format=fmt)
    monkeypatch.setattr(synthetic, "CHUNK_BYTES", 3 * (3 * 48 * 64 * 4) + 1)
    chunks = []
    real = synthetic._randn

    def spy(shape, *args):
        if len(shape) == 3 and shape[1:] == (2 * 48, 64):  # a chunk's gate_up draw
            chunks.append(shape[0])
        return real(shape, *args)

    monkeypatch.setattr(synthetic, "_randn", spy)
    stores = [synthetic.random_weights(cfg, 2, device="cpu", seed=5, pin=False).store for _ in range(2)]
    assert chunks == [3, 3, 2] * 2
    for bank in stores[0].banks:
        a, b = stores[0].tensor(bank.name), stores[1].tensor(bank.name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert all(bool(a[k].view(torch.uint8).any()) for k in range(8)), f"an expert of {bank.name} was not written"
