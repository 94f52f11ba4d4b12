"""Cost model: hand-computed estimates, the H200 profile against its measurements
(docs/simulator.md), monotonicity, shape matching and input validation."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.costmodel import (
    H200,
    SHAPES,
    DecodeEstimate,
    HardwareProfile,
    ModelShape,
    estimate_decode,
    format_profile,
    shape_for_meta,
)

MIB = 1 << 20

# Round numbers: 1 GB/s = 1000 bytes/us.
TOY = HardwareProfile(
    name="toy",
    h2d_points=((1000, 10.0), (3000, 20.0), (5000, 28.0)),
    h2d_ceiling_gbps=1.0,      # 1000 B/us past 5000 B
    back_to_back_gbps=0.3,     # 300 B/us: a further 3000 B expert takes 10 us
    hbm_gbps=1.0,              # 1000 B/us
    layer_overhead_us=5.0,
)
# expert 3*10*50*2 = 3000 B, shared 3000 B, router 4*10*2 = 80 B, non-MoE 920 B:
# batch 1 reads 80 + 2*3000 + 3000 + 920 = 10000 B = 10 us, + 5 us overhead = 15 us.
SHAPE = ModelShape(num_layers=2, num_experts=4, top_k=2, hidden=10, expert_intermediate=50,
                   shared_intermediate=50, non_moe_bytes_per_layer=920)
# 4 tokens; layer 0: 3 calls with 0 misses, 1 with 1; layer 1: 2 with 0, 1 with 1, 1 with 2.
HIST = np.array([[3, 1, 0], [2, 1, 1]], dtype=np.int64)


def test_a_policys_ensure_time_is_charged_every_call():
    """markov's learning launches: base + per_expert * E a layer call, on top of what lru pays; a policy
    the profile holds nothing for (and None) pays what lru does."""
    from dataclasses import replace

    prof = replace(TOY, policy_us=(("markov", 2.0, 0.5),))  # 2 + 0.5 * 4 experts = 4 us a call
    lru = estimate_decode(HIST, 4, SHAPE, prof, policy="lru")
    markov = estimate_decode(HIST, 4, SHAPE, prof, policy="markov")
    assert markov.compute_us_per_token == pytest.approx(lru.compute_us_per_token + 8 * 4.0 / 4)
    assert markov.copy_us_per_token == lru.copy_us_per_token
    assert estimate_decode(HIST, 4, SHAPE, prof).us_per_token == lru.us_per_token
    assert H200.policy_call_us("markov", 128) == pytest.approx(7.04, abs=0.01)  # bench_ensure, 1650 slots
    assert H200.policy_call_us("markov", 512) == pytest.approx(11.02, abs=0.01)
    assert H200.policy_call_us("rule", 512) == 0.0
    with pytest.raises(ValueError, match="policy_us"):
        replace(TOY, policy_us=(("markov", -1.0, 0.0),))


def test_toy_shape_bytes():
    assert SHAPE.expert_bytes == 3000
    assert SHAPE.shared_bytes == 3000
    assert SHAPE.router_bytes == 80
    assert SHAPE.layer_read_bytes(1) == 10000
    assert SHAPE.layer_read_bytes(2) == 16000      # 4 routed experts
    assert SHAPE.layer_read_bytes(5) == 16000      # capped at num_experts


def test_toy_copy_times():
    assert TOY.copy_us(3000, 0) == 0.0
    assert TOY.copy_us(3000, 1) == pytest.approx(20.0)
    assert TOY.copy_us(3000, 2) == pytest.approx(30.0)
    assert TOY.copy_us(3000, 3) == pytest.approx(40.0)


def test_hand_computed_serial():
    est = estimate_decode(HIST, 4, SHAPE, TOY)
    # compute 8 calls * 15 = 120; copies 20 + 20 + 30 = 70; over 4 tokens.
    assert est.compute_us_per_token == pytest.approx(30.0)
    assert est.copy_us_per_token == pytest.approx(17.5)
    assert est.exposed_copy_us_per_token == pytest.approx(17.5)
    assert est.us_per_token == pytest.approx(47.5)
    assert est.tokens_per_s == pytest.approx(1e6 / 47.5)
    assert est.bytes_copied_per_token == pytest.approx(4 * 3000 / 4)


def test_hand_computed_overlap():
    est = estimate_decode(HIST, 4, SHAPE, TOY, overlap=True)
    # shared expert 3 us hides under each copy: exposed 17 + 17 + 27 = 61.
    assert est.exposed_copy_us_per_token == pytest.approx(61 / 4)
    assert est.copy_us_per_token == pytest.approx(17.5)
    assert est.us_per_token == pytest.approx(30.0 + 61 / 4)


def test_overlap_hides_a_short_copy_entirely():
    big_shared = ModelShape(2, 4, 2, 10, 50, shared_intermediate=5000)  # 300 us shared expert
    est = estimate_decode(HIST, 4, big_shared, TOY, overlap=True)
    assert est.exposed_copy_us_per_token == 0.0
    assert est.us_per_token == pytest.approx(est.compute_us_per_token)
    assert est.copy_us_per_token == pytest.approx(17.5)


def test_hand_computed_batch():
    hist = np.array([[1, 0, 0, 0, 1], [0, 0, 2, 0, 0]], dtype=np.int64)
    est = estimate_decode(hist, 2, SHAPE, TOY, batch=2)
    # compute 16000 B = 16 us + 5 = 21 per call; copies 20 + 3 * 10 = 50 (4 misses), 30, 30.
    assert est.compute_us_per_token == pytest.approx(42.0)
    assert est.us_per_token == pytest.approx(42.0 + 110 / 2)
    assert est.tokens_per_s == pytest.approx(2e6 / 97.0)
    assert est.bytes_copied_per_token == pytest.approx(8 * 3000 / 2)


def test_zero_misses_is_compute_only():
    hist = np.array([[7, 0, 0], [7, 0, 0]], dtype=np.int64)
    for overlap in (False, True):
        est = estimate_decode(hist, 7, SHAPE, TOY, overlap=overlap)
        assert est.us_per_token == pytest.approx(30.0)
        assert est.copy_us_per_token == est.exposed_copy_us_per_token == 0.0
        assert est.bytes_copied_per_token == 0.0


def test_more_misses_is_slower_and_overlap_never_slower():
    shape = SHAPES["qwen3-next"]
    previous = None
    for m in range(11):
        hist = np.zeros((48, 11), dtype=np.int64)
        hist[:, 0] = 10
        hist[:, m] += 5
        serial = estimate_decode(hist, 15, shape)
        hidden = estimate_decode(hist, 15, shape, overlap=True)
        assert hidden.us_per_token <= serial.us_per_token
        if m:
            assert serial.us_per_token - hidden.us_per_token == pytest.approx(
                5 * 48 * shape.shared_bytes / (H200.hbm_gbps * 1e3) / 15)
        if previous is not None:
            assert serial.us_per_token > previous
        previous = serial.us_per_token


def test_histogram_is_not_averaged():
    # Same 2 misses in total per layer: one call of 2 costs less than two calls of 1
    # (only the first copy of a call pays the single-copy latency).
    spread = estimate_decode(np.array([[0, 2, 0], [0, 2, 0]]), 2, SHAPE, TOY)
    bunched = estimate_decode(np.array([[1, 0, 1], [1, 0, 1]]), 2, SHAPE, TOY)
    assert spread.bytes_copied_per_token == bunched.bytes_copied_per_token
    assert spread.us_per_token - bunched.us_per_token == pytest.approx((80 - 60) / 2)


def test_interpolation_hits_table_points():
    for size, us in TOY.h2d_points + H200.h2d_points:
        profile = TOY if size <= 5000 else H200
        assert profile.single_copy_us(size) == pytest.approx(us, abs=1e-9)
    assert TOY.single_copy_us(2000) == pytest.approx(15.0)
    assert TOY.single_copy_us(4000) == pytest.approx(24.0)


def test_extrapolation_past_and_below_the_table():
    assert TOY.single_copy_us(7000) == pytest.approx(28.0 + 2000 / 1000)
    assert TOY.single_copy_us(500) == pytest.approx(7.5)      # first segment extended
    assert TOY.single_copy_us(1) > 0
    steep = HardwareProfile("steep", ((1000, 10.0), (2000, 30.0)), 1.0, 1.0, 1.0, 0.0)
    assert steep.single_copy_us(500) == pytest.approx(5.0)    # never faster than point 0
    gib = 1 << 30
    tail = H200.single_copy_us(gib) - H200.single_copy_us(512 * MIB)
    assert 512 * MIB / tail / 1e3 == pytest.approx(55.4)


@given(st.integers(1, 2 << 30), st.integers(1, 2 << 30))
def test_single_copy_monotone_in_size(a, b):
    lo, hi = sorted((a, b))
    assert H200.single_copy_us(lo) <= H200.single_copy_us(hi)


def test_h200_matches_limits():
    assert H200.single_copy_us(round(1.7 * MIB)) == pytest.approx(41.9)
    ten = H200.copy_us(round(6.3 * MIB), 10)
    assert ten == pytest.approx(1240.8, rel=0.01)             # measured back to back
    qwen = SHAPES["qwen3-next"]
    assert qwen.layer_read_bytes(1) == 71_303_168              # 71.3 MB
    assert qwen.layer_read_bytes(1) / (H200.hbm_gbps * 1e3) == pytest.approx(16.9, abs=0.01)
    line = format_profile(H200)
    assert "nvidia-h200" in line and "55.4" in line and "4219" in line


def test_shapes():
    assert SHAPES["qwen3-next"].expert_bytes == 6 * MIB
    assert SHAPES["qwen3-30b-a3b"].expert_bytes == 9 * MIB
    assert SHAPES["qwen3-30b-a3b"].shared_bytes == 0
    assert SHAPES["mixtral-8x7b"].expert_bytes == 3 * 4096 * 14336 * 2
    assert SHAPES["flame-290m"].expert_bytes == 3 * 1024 * 704 * 2


def test_shape_for_meta():
    flame = shape_for_meta("FLAME-MoE-290M-1.3B (8 MoE layers)", 8, 64, 6, None)
    assert flame == SHAPES["flame-290m"]
    fp8 = shape_for_meta("Mixtral-8x7B-Instruct (FP8)", 32, 8, 2, 176_160_768)
    assert fp8.expert_bytes == 176_160_768 and fp8.hidden == 4096
    short = shape_for_meta("qwen3-next", 4, 512, 10, None)
    assert short.num_layers == 4 and short.shared_intermediate == 512
    oss = shape_for_meta("gpt-oss-20b", 24, 32, 4, None)
    assert oss == SHAPES["gpt-oss-20b"] and oss.hidden == 2880
    generic = shape_for_meta("unknown", 12, 48, 4, 3 * 2048 * 1024 * 2)  # no shape has 48 experts top-4
    assert generic.expert_bytes == 3 * 2048 * 1024 * 2
    assert (generic.num_layers, generic.num_experts, generic.top_k) == (12, 48, 4)
    odd = shape_for_meta("unknown", 12, 48, 4, 1_000_001)
    assert odd.expert_bytes == 1_000_001
    with pytest.raises(ValueError, match="expert_bytes"):
        shape_for_meta("unknown", 12, 48, 4, None)


def test_estimate_is_plain_floats():
    est = estimate_decode(HIST, 4, SHAPE, TOY)
    assert isinstance(est, DecodeEstimate)
    assert all(type(v) is float for v in est.to_dict().values())


@pytest.mark.parametrize("call, name", [
    (lambda: TOY.copy_us(-1, 1), "expert_bytes"),
    (lambda: TOY.copy_us(0, 1), "expert_bytes"),
    (lambda: TOY.copy_us(3000, -1), "misses"),
    (lambda: TOY.single_copy_us(-5), "expert_bytes"),
    (lambda: estimate_decode(HIST, 0, SHAPE, TOY), "tokens"),
    (lambda: estimate_decode(HIST, -3, SHAPE, TOY), "tokens"),
    (lambda: estimate_decode(HIST, 5, SHAPE, TOY), "tokens"),
    (lambda: estimate_decode(HIST.astype(np.float64), 4, SHAPE, TOY), "hist"),
    (lambda: estimate_decode(HIST.tolist(), 4, SHAPE, TOY), "hist"),
    (lambda: estimate_decode(HIST[:1], 4, SHAPE, TOY), "hist"),
    (lambda: estimate_decode(HIST[:, :2], 4, SHAPE, TOY), "hist"),
    (lambda: estimate_decode(HIST.ravel(), 4, SHAPE, TOY), "hist"),
    (lambda: estimate_decode(HIST, 4, SHAPE, TOY, batch=2), "hist"),
    (lambda: estimate_decode(HIST, 4, SHAPE, TOY, batch=0), "batch"),
    (lambda: estimate_decode(-HIST, 4, SHAPE, TOY), "hist"),
    (lambda: ModelShape(2, 4, 2, -10, 50), "hidden"),
    (lambda: ModelShape(2, 4, 5, 10, 50), "top_k"),
    (lambda: ModelShape(2, 4, 2, 10, 50, non_moe_bytes_per_layer=-1), "non_moe_bytes"),
    (lambda: ModelShape(2, 4, 2, 10, 50, routed_expert_bytes=0), "routed_expert_bytes"),
    (lambda: HardwareProfile("x", ((1000, 10.0),), 1.0, 1.0, 1.0, 0.0), "h2d_points"),
    (lambda: HardwareProfile("x", ((2000, 10.0), (1000, 20.0)), 1.0, 1.0, 1.0, 0.0),
     "h2d_points"),
    (lambda: HardwareProfile("x", ((-1, 10.0), (1000, 20.0)), 1.0, 1.0, 1.0, 0.0),
     "h2d_points"),
    (lambda: HardwareProfile("x", ((1000, 10.0), (2000, 20.0)), 1.0, 0.0, 1.0, 0.0),
     "back_to_back_gbps"),
    (lambda: HardwareProfile("x", ((1000, 10.0), (2000, 20.0)), 1.0, 1.0, 1.0, -1.0),
     "layer_overhead_us"),
])
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
