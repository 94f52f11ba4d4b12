"""The miss services in the cost model and in `expertcache sim`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.split import TAIL_TIE, MissSplit
from moe.cli import main
from sim.costmodel import SHAPES, estimate_decode
from sim.service import HOSTS, HostProfile, estimate_service
from sim.synthetic import generate, preset
from sim.trace import save_trace

SHAPE = SHAPES["qwen3-30b-a3b"]


def _hist(rng, tokens=50, shape=SHAPE) -> np.ndarray:
    L, q = shape.num_layers, shape.top_k + 1
    hist = np.zeros((L, q), dtype=np.int64)
    for layer in range(L):
        np.add.at(hist[layer], rng.integers(0, q, tokens), 1)
    return hist


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_copy_service_is_the_plain_estimate(host):
    h = HOSTS[host]
    hist = _hist(np.random.default_rng(1))
    est = estimate_service(hist, 50, SHAPE, h, MissSplit.copy())
    ref = estimate_decode(hist, 50, SHAPE, h.gpu)
    assert est.us_per_token == pytest.approx(ref.us_per_token, rel=1e-12)
    assert est.served_per_token == 0 and est.cpu_us_per_token == 0


def test_hybrid_prices_each_call_at_its_slower_channel():
    h = HOSTS["h100-host"]
    B = SHAPE.expert_bytes
    split = h.split("hybrid", B)
    hist = np.zeros((SHAPE.num_layers, SHAPE.top_k + 1), dtype=np.int64)
    hist[:, 6] = 1  # one token, 6 misses a layer
    c = split.copies_for(6)
    assert 0 < c < 6
    link = h.gpu.single_copy_us(B) - B / (h.gpu.back_to_back_gbps * 1e3) + c * B / (h.link_together_gbps * 1e3)
    cpu = h.cpu_fixed_us + (6 - c) * B / (h.cpu_together_gbps * 1e3)
    est = estimate_service(hist, 1, SHAPE, h, split)
    copy = estimate_service(hist, 1, SHAPE, h, MissSplit.copy())
    assert est.miss_us_per_token == pytest.approx(SHAPE.num_layers * max(link, cpu))
    assert est.copies_per_token == SHAPE.num_layers * c and est.served_per_token == SHAPE.num_layers * (6 - c)
    assert est.tokens_per_s > copy.tokens_per_s
    # every routed expert on the CPU, alone on the DRAM: its alone rate
    cpu_only = estimate_service(hist, 1, SHAPE, h, MissSplit.cpu())
    assert cpu_only.miss_us_per_token == pytest.approx(SHAPE.num_layers * (h.cpu_fixed_us + 6 * B / (h.cpu_gbps * 1e3)))


def test_a_tail_prices_its_share_of_an_expert_on_each_channel():
    """With a tail, a call's m misses cost max(link(c + f), cpu(m - c - f)), f the tail's share of one expert;
    the tail split is never slower than whole experts on the same calls (beyond the tie it gives to more copies),
    and counts fractional experts."""
    h = HOSTS["h100-host"]
    B, inter = SHAPE.expert_bytes, SHAPE.expert_intermediate
    whole = h.split("hybrid", B)
    split = h.split("hybrid", B, inter, 16)
    assert split.tail and not whole.tail
    hist = np.zeros((SHAPE.num_layers, SHAPE.top_k + 1), dtype=np.int64)
    hist[:, 6] = 1
    c, r = split.copies_for(6), int(split.link_rows[6])
    assert r > 0
    costs = h.costs(B)
    est = estimate_service(hist, 1, SHAPE, h, split)
    assert est.miss_us_per_token == pytest.approx(SHAPE.num_layers * float(costs.step_us(6, c, r / inter)))
    assert est.copies_per_token == pytest.approx(SHAPE.num_layers * (c + r / inter))
    assert est.served_per_token == pytest.approx(SHAPE.num_layers * (6 - c - r / inter))
    rng = np.random.default_rng(3)
    for _ in range(5):
        hist = _hist(rng)
        assert estimate_service(hist, 50, SHAPE, h, split).miss_us_per_token <= \
            estimate_service(hist, 50, SHAPE, h, whole).miss_us_per_token * (1 + TAIL_TIE)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_overlap_hides_the_shared_expert_under_each_service_as_under_copy(host):
    h, shape = HOSTS[host], SHAPES["qwen3-next"]  # a block with a shared expert
    hist = _hist(np.random.default_rng(2), shape=shape)
    copy = estimate_service(hist, 50, shape, h, MissSplit.copy(), overlap=True)
    ref = estimate_decode(hist, 50, shape, h.gpu, overlap=True)
    assert copy.us_per_token == pytest.approx(ref.us_per_token, rel=1e-12)
    shared = shape.shared_bytes / (h.gpu.hbm_gbps * 1e3)
    assert shared > 0
    calls_with_misses = int(hist[:, 1:].sum())
    for split in (h.split("hybrid", shape.expert_bytes), MissSplit.cpu()):
        off, on = (estimate_service(hist, 50, shape, h, split, overlap=o) for o in (False, True))
        hidden = (off.us_per_token - on.us_per_token) * 50  # at most the shared expert, per call with misses
        assert 0 < hidden <= calls_with_misses * shared + 1e-6
        assert on.link_us_per_token == off.link_us_per_token and on.cpu_us_per_token == off.cpu_us_per_token


def test_measured_formats_and_overrides():
    h = HOSTS["h100-host"]
    int4 = h.for_format("int4")
    assert int4.cpu_together_gbps < h.cpu_together_gbps and h.for_format("bf16") is h
    given = h.with_rates(cpu_gbps=30.0)
    assert given.for_format("int4").cpu_together_gbps == 30.0, "--cpu-gbps applies to every format"


def test_faster_cpu_sends_more_to_the_cpu():
    h = HOSTS["desktop"]
    slow, fast = h.with_rates(cpu_gbps=20.0), h.with_rates(cpu_gbps=80.0)
    B = SHAPE.expert_bytes
    assert slow.split("hybrid", B).copies_for(8) > fast.split("hybrid", B).copies_for(8)
    with pytest.raises(ValueError, match="link_together_gbps"):
        HostProfile("x", h.gpu, 0.0, 1.0, 1.0, 1.0, "")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "small.npz"
    save_trace(generate(preset("qwen3-30b-a3b", num_tokens=40, seed=2)), path)
    return str(path)


def test_sim_prints_the_services_and_the_faster_one(capsys, small_trace):
    assert main(["sim", small_trace, "--policies", "lru,markov", "--slots-frac", "0.1,0.5", "--workers", "1",
                 "--miss-service", "copy,hybrid,cpu", "--host", "desktop"]) == 0
    out = capsys.readouterr().out
    assert "miss service, modeled on host desktop" in out
    assert "choice of miss service by modeled tok/s" in out
    section = out[out.index("miss service, modeled"):]
    choices = [line for line in section[section.index("choice of miss service"):].splitlines()[1:] if line]
    assert len(choices) == 2 and all(" with " in line for line in choices)


def test_sim_json_carries_each_rows_services(capsys, small_trace):
    assert main(["sim", small_trace, "--policies", "lru", "--slots-frac", "0.1", "--workers", "1", "--json",
                 "--cpu-gbps", "40", "--link-gbps", "20"]) == 0
    rows = json.loads(capsys.readouterr().out)
    lru = [r for r in rows if r["policy"] == "lru"]
    assert len(lru) == 1
    services = lru[0]["miss_service"]
    assert set(services) == {"copy", "hybrid"}
    assert services["copy"]["tokens_per_s"] == pytest.approx(lru[0]["tokens_per_s"], rel=1e-9)
    assert services["hybrid"]["served_per_token"] > 0 and services["hybrid"]["copies_per_token"] > 0
    # the belady reference has no hybrid replay of next-token, but belady's own runs
    assert all("miss_service" in r for r in rows)


def test_copy_only_prints_no_service_section(capsys, small_trace):
    assert main(["sim", small_trace, "--policies", "lru", "--slots-frac", "0.1", "--workers", "1",
                 "--miss-service", "copy"]) == 0
    assert "miss service" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--miss-service", "auto"], "--miss-service"),
    (["--miss-service", ""], "--miss-service"),
    (["--link-gbps", "0"], "--link-gbps"),
    (["--cpu-gbps", "-3"], "--cpu-gbps"),
    (["--host", "laptop"], "--host"),
])
def test_bad_service_flags_name_the_flag(argv, needle, small_trace, capsys):
    with pytest.raises(SystemExit) as err:
        main(["sim", small_trace, *argv])
    assert needle in str(err.value) + capsys.readouterr().err


def test_replay_counts_calls_by_misses_and_copies(small_trace):
    from sim.replay import replay
    from sim.trace import load_trace

    trace = load_trace(small_trace)
    h = HOSTS["desktop"]
    split = h.split("hybrid", SHAPE.expert_bytes)
    r = replay(trace, "lru", 200, split=split)
    m, c = np.nonzero(r.split_hist)
    assert r.split_hist.sum() == r.calls and (c <= m).all()
    assert (r.split_hist[m, c] * (m - c)).sum() == r.served
    # the pool fills first: calls with empty slots copied more than the table says
    assert any(c_ > split.copies_for(m_) for m_, c_ in zip(m, c))
    with_hist = estimate_service(r.hist, r.tokens, SHAPE, h, split, split_hist=r.split_hist)
    assert with_hist.served_per_token * r.tokens == pytest.approx(r.served)
    cpu = replay(trace, "lru", 200, split=MissSplit.cpu())
    a = estimate_service(cpu.hist, cpu.tokens, SHAPE, h, MissSplit.cpu(), split_hist=cpu.split_hist)
    b = estimate_service(cpu.hist, cpu.tokens, SHAPE, h, MissSplit.cpu())
    assert a.us_per_token == pytest.approx(b.us_per_token, rel=1e-12)


def test_a_given_link_prices_copies_alone_and_beside_the_cpu():
    """--link-gbps: the copy table at that link (HardwareProfile.at_link) and the link beside the CPU."""
    base = HOSTS["h100-host"]
    slow = base.with_rates(link_gbps=base.gpu.back_to_back_gbps / 2)
    size = 9 * 2**20
    assert slow.link_together_gbps == base.gpu.back_to_back_gbps / 2
    for m in (1, 2, 5):
        assert slow.gpu.copy_us(size, m) == pytest.approx(2 * base.gpu.copy_us(size, m), rel=1e-12)
    assert slow.costs(size).link_alone_per_expert_us == pytest.approx(2 * base.costs(size).link_alone_per_expert_us)
    assert slow.gpu.hbm_gbps == base.gpu.hbm_gbps and slow.gpu.layer_overhead_us == base.gpu.layer_overhead_us
