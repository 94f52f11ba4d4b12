"""The MoE decode layer over quantized experts (fp8, nvfp4, mxfp4, int4): against the torch reference on the
dequantized experts, and the side-stream overlap against the single stream, bit for bit.

    random_weights(MoEConfig(expert_format=F)): the random bf16 experts quantized, in F's host-store banks
    SyntheticModel: the miss copy moves every bank of a missing expert; the routed launches dequantize
    CPU (interpreter, tiny): an evicting step; every layer within bf16 tolerance of moe_reference on the
        dequantized experts (tests/moe/engine/test_layer.close_to_reference); warm_all fills every bank's bytes
    GPU (`gpu`): every format against the reference; fp8 and nvfp4 with overlap on vs off: outputs, slot
        maps and every bank of every filled slot bitwise equal, batch 1 and 2, eager and CUDA graph,
        evictions every step
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.kernels.plan import QUANTIZED_ROUTED_TILES, OverlapMode
from moe.testing.synthetic import SyntheticModel, random_weights
from tests.moe.engine.test_layer import (
    BF16,
    CPU_CFG,
    CPU_L,
    CPU_S,
    GPU_CFG,
    GPU_L,
    GPU_S,
    assert_steps_bitwise,
    close_to_reference,
    misses,
)

FORMATS = ("fp8", "nvfp4", "mxfp4", "int4")


@pytest.mark.cpu_only
def test_layer_matches_reference_cpu():
    """nvfp4 (the routed kernels of every format: tests/moe/kernels/test_routed_formats.py), an evicting step."""
    cfg = dataclasses.replace(CPU_CFG, expert_format="nvfp4")
    model = SyntheticModel(random_weights(cfg, CPU_L, "cpu", seed=3), CPU_S, "cpu")
    plan = model.layers[0].plan
    assert plan.routed_tiles == QUANTIZED_ROUTED_TILES and plan.down_prefetch == 0
    close_to_reference(model, torch.randn(2, cfg.hidden, generator=torch.Generator().manual_seed(4)).to(BF16))
    assert misses(model) > 0


@pytest.mark.cpu_only
def test_warm_all_copies_every_bank_cpu():
    cfg = dataclasses.replace(CPU_CFG, num_experts=6, expert_format="nvfp4")
    weights = random_weights(cfg, CPU_L, "cpu", seed=5)
    assert [b.name for b in weights.store.banks] == ["gate_up.q", "gate_up.s", "gate_up.s2", "down.q", "down.s",
                                                     "down.s2"]
    model = SyntheticModel(weights, CPU_L * 6, "cpu")
    model.warm_all()
    slot_of = model.slots.cache.slot_of.long()
    for bank in weights.store.banks:
        assert torch.equal(model.slots.pool.tensor(bank.name)[slot_of], weights.store.tensor(bank.name)), bank.name


@pytest.fixture(scope="module")
def gpu_models():
    """Per format, the random GPU_CFG experts quantized (built once)."""
    return {f: random_weights(dataclasses.replace(GPU_CFG, expert_format=f), GPU_L, "cuda", seed=11) for f in FORMATS}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_matches_reference_gpu(gpu_models, fmt):
    model = SyntheticModel(gpu_models[fmt], 8 * GPU_CFG.top_k, "cuda", copy_overlap=True)  # 8 tokens fit
    gen = torch.Generator("cuda").manual_seed(9)
    for tokens in (1, 2, 8):
        close_to_reference(model, torch.randn(tokens, GPU_CFG.hidden, generator=gen, device="cuda").to(BF16))
    model.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_overlap_on_off_bitwise(gpu_models, fmt, graph, tokens):
    off = SyntheticModel(gpu_models[fmt], GPU_S, "cuda", copy_overlap=False)
    on = SyntheticModel(gpu_models[fmt], GPU_S, "cuda", copy_overlap=True)
    assert off.layers[0].plan.mode is OverlapMode.INLINE
    assert on.layers[0].plan.mode is OverlapMode.SHARED_AND_HITS_ON_SIDE, on.layers[0].plan.reason
    assert_steps_bitwise(off, on, graph, tokens, seed=tokens)
    on.close()
