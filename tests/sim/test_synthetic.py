"""Synthetic routing traces: determinism, format invariants, validation, presets, skew and
reuse monotonicity, and calibration against the real traces (skipped when they are absent)."""

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import synthetic as syn
from sim.replay import replay
from sim.trace import Trace, load_trace

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SMALL = syn.SyntheticConfig(num_layers=4, num_experts=16, top_k=3, num_tokens=120, batch=2,
                            request_tokens=30, with_logits=True, seed=7)


def _real(name: str) -> Trace:
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"real trace {path} not present (it lives beside the checkout, not in it)")
    return load_trace(path)


def _check_invariants(cfg: syn.SyntheticConfig, t: Trace) -> None:
    N, L, B, k, E = cfg.num_tokens, cfg.num_layers, cfg.batch, cfg.top_k, cfg.num_experts
    t.validate()
    assert t.experts.shape == (N, L, B, k) and t.experts.dtype == np.int32
    assert t.experts.min() >= 0 and t.experts.max() < E
    s = np.sort(t.experts, axis=-1)
    assert (s[..., 1:] != s[..., :-1]).all()
    assert t.weights.shape == t.experts.shape and t.weights.dtype == np.float32
    assert (t.weights > 0).all()
    np.testing.assert_allclose(t.weights.sum(-1), 1.0, atol=1e-5)
    assert t.req_index.shape == (N, B) and t.req_index.dtype == np.int32
    assert (np.diff(t.req_index, axis=0) >= 0).all()
    if cfg.with_logits:
        T = min(2 * k, E)
        assert t.logit_idx.shape == (N, L, B, T) and t.logit_idx.dtype == np.int32
        assert t.logit_val.shape == (N, L, B, T) and t.logit_val.dtype == np.float32
        assert (t.logit_idx[..., :k] == t.experts).all()
        assert (np.diff(t.logit_val, axis=-1) <= 0).all()
        s = np.sort(t.logit_idx, axis=-1)
        assert (s[..., 1:] != s[..., :-1]).all()
    else:
        assert t.logit_idx is None and t.logit_val is None


def test_same_seed_same_trace_other_seed_other_trace():
    a, b = syn.generate(SMALL), syn.generate(SMALL)
    assert a == b
    c = syn.generate(replace(SMALL, seed=8))
    assert not np.array_equal(a.experts, c.experts)


def test_shapes_dtypes_ranges_and_weights():
    for cfg in (SMALL, replace(SMALL, with_logits=False, batch=1)):
        _check_invariants(cfg, syn.generate(cfg))


@settings(max_examples=25)
@given(L=st.integers(1, 4), E=st.integers(1, 24), k=st.integers(1, 8), N=st.integers(1, 40),
       B=st.integers(1, 3), reuse=st.floats(0, 0.95), decay=st.floats(0, 0.95),
       topic=st.floats(0, 2), zipf=st.floats(0, 3), logits=st.booleans(), seed=st.integers(0, 99))
def test_invariants_hold_for_any_config(L, E, k, N, B, reuse, decay, topic, zipf, logits, seed):
    cfg = syn.SyntheticConfig(L, E, min(k, E), N, batch=B, zipf=zipf, reuse=reuse,
                              reuse_decay=decay, topic=topic, request_tokens=7,
                              with_logits=logits, seed=seed)
    _check_invariants(cfg, syn.generate(cfg))


def test_logits_are_consistent_with_choices_and_weights():
    t = syn.generate(SMALL)
    k = SMALL.top_k
    chosen = t.logit_val[..., :k].astype(np.float64)
    w = np.exp(chosen - chosen.max(-1, keepdims=True))
    np.testing.assert_allclose(t.weights, w / w.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert (t.logit_val[..., k - 1] >= t.logit_val[..., k]).all()  # chosen = the top-k logits


def test_logits_leave_near_misses_for_the_rule_refresh():
    cfg = syn.preset("qwen3-next", num_tokens=20, with_logits=True)
    v = syn.generate(cfg).logit_val
    near = v[..., cfg.top_k:] >= v[..., cfg.top_k - 1:cfg.top_k] - 0.25
    assert near.any(-1).mean() > 0.5


def test_requests_have_the_configured_mean_length():
    cfg = syn.SyntheticConfig(2, 8, 2, 4000, request_tokens=40)
    req = syn.generate(cfg).req_index[:, 0]
    assert req[0] == 0 and (np.diff(req) <= 1).all()
    assert 30 < cfg.num_tokens / (req[-1] + 1) < 50


def test_meta_records_the_config():
    t = syn.generate(SMALL)
    assert t.meta.phase == "decode" and t.meta.license == "CC0-1.0"
    assert t.meta.source.startswith("synthetic:")
    assert json.loads(t.meta.source[len("synthetic:"):]) == asdict(SMALL)
    assert (t.meta.num_layers, t.meta.num_experts, t.meta.top_k) == (4, 16, 3)


@pytest.mark.parametrize("field, value", [
    ("num_layers", 0), ("num_experts", -1), ("top_k", 0), ("top_k", 17), ("num_tokens", 0),
    ("batch", 0), ("batch", 1.5), ("num_tokens", True), ("zipf", -0.1), ("zipf", float("nan")),
    ("reuse", 1.0), ("reuse", -0.01), ("reuse_decay", 1.0), ("topic", -1.0),
    ("request_tokens", 0), ("logit_scale", 0.0), ("seed", -1), ("expert_bytes", 0),
    ("model", ""), ("with_logits", 1), ("zipf", "1"),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(SMALL, **{field: value})


def test_presets_generate_valid_traces():
    for name in syn.PRESETS:
        cfg = syn.preset(name, num_tokens=12, with_logits=True)
        _check_invariants(cfg, syn.generate(cfg))
    q = syn.PRESETS["qwen3-next"]
    assert (q.num_layers, q.num_experts, q.top_k) == (48, 512, 10) and q.num_tokens >= 2000
    assert q.expert_bytes == 3 * 2048 * 512 * 2
    assert syn.PRESETS["qwen3-30b-a3b"].expert_bytes == 3 * 2048 * 768 * 2
    assert syn.PRESETS["mixtral"].expert_bytes == 3 * 4096 * 14336 * 2


def test_preset_overrides_and_unknown_names():
    assert syn.preset("mixtral", seed=3, num_tokens=9).seed == 3
    with pytest.raises(ValueError, match="qwen3-next"):
        syn.preset("nope")
    with pytest.raises(ValueError, match="reuse"):
        syn.preset("mixtral", reuse=2.0)


def test_zipf_for_spread_is_shape_aware():
    assert syn.zipf_for_spread(0.5, 1) == 0.0
    for E in (8, 64, 512):
        z = syn.zipf_for_spread(0.32, E)
        assert abs(z * np.log(np.arange(1, E + 1)).std() - 0.32) < 1e-3


def _lru(cfg: syn.SyntheticConfig, slots: int) -> float:
    return replay(syn.generate(cfg), "lru", slots).hit_rate


def test_higher_zipf_gives_higher_lru_hit_rate():
    cfg = syn.SyntheticConfig(4, 32, 2, 600, reuse=0.0, topic=0.0)
    rates = [_lru(replace(cfg, zipf=z), 32) for z in (0.0, 0.5, 1.0, 2.0)]
    assert rates == sorted(rates) and rates[-1] - rates[0] > 0.2


def test_higher_reuse_gives_higher_lru_hit_rate():
    cfg = syn.SyntheticConfig(4, 32, 2, 600, zipf=0.3, topic=0.0)
    rates = [_lru(replace(cfg, reuse=r), 32) for r in (0.0, 0.3, 0.6, 0.9)]
    assert rates == sorted(rates) and rates[-1] - rates[0] > 0.2


def test_qwen3_next_default_length_is_fast():
    syn.generate(syn.preset("qwen3-next", num_tokens=2))  # compiled kernels loaded
    t0 = time.perf_counter()
    t = syn.generate(syn.PRESETS["qwen3-next"])
    assert time.perf_counter() - t0 < 5.0
    assert t.experts.shape == (2000, 48, 1, 10)


@pytest.mark.parametrize("trace, name, slots", [
    ("mixtral-gsm8k.npz", "mixtral-like", [32, 64, 96, 128, 160, 192, 224]),
    ("flame-290m-a.npz", "flame-like", [64, 128, 256, 384, 448]),
])
def test_calibrated_presets_track_the_real_hit_rate_curves(trace, name, slots):
    real = _real(trace)
    cfg = syn.preset(name)
    assert (real.num_tokens, real.num_layers, real.num_experts, real.top_k) == (
        cfg.num_tokens, cfg.num_layers, cfg.num_experts, cfg.top_k)
    rows = syn.calibration_table(real, cfg, syn.calibration_slots(real, slots))
    assert [r["slots"] for r in rows] == sorted(set(slots))  # the README slots cover 25/50/75 %
    assert syn.max_gap(rows) < 0.04, rows


def _trace_of(experts: np.ndarray, num_experts: int):
    from tests.sim.test_replay import make_trace

    return make_trace(experts.astype(np.int32), num_experts)


def test_predictability_counts_a_small_trace_by_hand():
    # one layer, top-1 of 3: 0, 1, 0, 1. Token 3 is the first with a transition counted (0 -> 1 at
    # token 1): predicted 1, right; by popularity (1 and 0 once each, the lower id first) 0, wrong
    trace = _trace_of(np.array([0, 1, 0, 1]).reshape(4, 1, 1, 1), 3)
    assert syn.predictability(trace, warm=1) == {"transition": 1.0, "frequency": 0.0, "lift": 1.0}


def test_successor_routing_is_predicted_by_transitions_and_iid_routing_is_not():
    rng = np.random.default_rng(4)
    N, L, E = 400, 3, 16
    succ = np.stack([rng.permutation(E) for _ in range(L)])  # each layer's fixed successor of each expert
    ex = np.empty((N, L, 1, 2), dtype=np.int64)
    ex[0, :, 0] = [[0, 1]] * L
    for t in range(1, N):
        for layer in range(L):
            a = ex[t - 1, layer, 0, 0]
            ex[t, layer, 0] = [succ[layer, a], (succ[layer, a] + 1 + rng.integers(E - 1)) % E]
    got = syn.predictability(_trace_of(ex, E))
    assert got["transition"] > 0.45 and got["lift"] > 0.3  # the first of the two is always predictable
    iid = np.stack([rng.choice(E, 2, replace=False) for _ in range(N * L)]).reshape(N, L, 1, 2)
    got = syn.predictability(_trace_of(iid, E))
    assert abs(got["lift"]) < 0.05


def test_the_synthetic_model_has_no_transitions():
    """Its routing follows the previous token only through the working set (docs/synthetic.md): as
    predictable from popularity as from transitions, unlike real routing."""
    got = syn.predictability(syn.generate(syn.preset("flame-like")))
    assert abs(got["lift"]) < 0.01 and got["transition"] > 0.1
