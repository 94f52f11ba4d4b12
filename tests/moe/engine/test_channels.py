"""The channels measured at start (moe.engine.channels) and the split they give (resolve_miss_service).

    ChannelMeasure (call times) ─costs()─► ChannelCosts ─MissSplit.hybrid─► table; choose_service: auto's pick
The arithmetic and the choice on the CPU with measures given; measure_channels itself on the GPU
(tests/moe/engine/test_hybrid_gpu.py)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from expertcache.split import TAIL_TIE, MissSplit
from moe.engine.channels import ROTATION_BYTES, ChannelMeasure, choose_service, measure_channels, rotation
from moe.engine.loading import choose_miss_service, resolve_miss_service
from moe.kernels import cpu_experts

MIB = 1 << 20


def _measure(link_per: float, cpu_per: float, link_fixed: float = 5.0, cpu_fixed: float = 10.0,
             link_slow: float = 1.0, cpu_slow: float = 1.0, n: int = 8, top_k: int = 8) -> ChannelMeasure:
    """A measure whose channels cost fixed + per * experts alone, slowed by *_slow beside each other."""
    return ChannelMeasure(4 * MIB, n, top_k, link_fixed + link_per, link_fixed + n * link_per,
                          link_fixed + n * link_per * link_slow, cpu_fixed + cpu_per, cpu_fixed + n * cpu_per,
                          cpu_fixed + n * cpu_per * cpu_slow, 14, 1.1)


def test_costs_recover_the_fixed_and_per_expert_parts():
    c = _measure(80.0, 100.0, link_slow=1.25, cpu_slow=1.5).costs()
    assert c.link_fixed_us == pytest.approx(5.0) and c.cpu_fixed_us == pytest.approx(10.0)
    assert c.link_alone_per_expert_us == pytest.approx(80.0) and c.link_per_expert_us == pytest.approx(100.0)
    assert c.cpu_alone_per_expert_us == pytest.approx(100.0) and c.cpu_per_expert_us == pytest.approx(150.0)
    g = _measure(80.0, 100.0).gbps()
    assert g["link_alone"] == pytest.approx(4 * MIB / 80e3) and g["cpu_together"] == pytest.approx(4 * MIB / 100e3)


def test_a_slope_lost_in_noise_has_no_fixed_part():
    m = ChannelMeasure(MIB, 8, 8, 50.0, 40.0, 45.0, 20.0, 100.0, 120.0, 4, 1.0)  # link: 8 experts faster than 1
    c = m.costs()
    assert c.link_fixed_us == 0 and c.link_alone_per_expert_us == pytest.approx(5.0)
    assert c.link_per_expert_us == pytest.approx(45.0 / 8)


def test_a_channel_slower_alone_than_beside_the_other_is_measured_again():
    """A measurement whose link or CPU read slower alone than together (by more than ALONE_OVER_TOGETHER) was
    disturbed: until_consistent measures again, MEASURE_TRIES times at most, and keeps the last."""
    from moe.engine.channels import MEASURE_TRIES, until_consistent

    good = _measure(80.0, 2000.0)
    assert good.consistent
    slow_cpu_alone = dataclasses.replace(good, cpu_one_us=good.cpu_one_us * 3, cpu_all_us=good.cpu_all_us * 3)
    slow_link_alone = dataclasses.replace(good, link_one_us=good.link_one_us * 3, link_all_us=good.link_all_us * 3)
    assert not slow_cpu_alone.consistent and not slow_link_alone.consistent
    got = iter([slow_cpu_alone, slow_link_alone, good, slow_cpu_alone])
    calls = []
    assert until_consistent(lambda: calls.append(1) or next(got)) is good and len(calls) == 3
    calls.clear()
    assert until_consistent(lambda: calls.append(1) or slow_cpu_alone) is slow_cpu_alone
    assert len(calls) == MEASURE_TRIES


def test_auto_picks_hybrid_when_the_cpu_helps_and_copy_when_it_does_not():
    fast_cpu = _measure(80.0, 100.0).costs()
    service, why = choose_service(fast_cpu, 8)
    assert service == "hybrid" and "copy" in why and "hybrid" in why
    slow_cpu = _measure(80.0, 2000.0).costs()  # the CPU takes 25x the link's time per expert
    assert choose_service(slow_cpu, 8)[0] == "copy"
    # together the link slows to half: what the CPU adds is less than the link loses beside it
    contended = _measure(80.0, 400.0, link_slow=2.0, cpu_slow=2.0).costs()
    assert choose_service(contended, 8)[0] == "copy"
    assert MissSplit.hybrid(contended).copies_for(8) < 8, "the table alone would still split"
    # the post and wait every hybrid layer call launches, served or not: dear ones tip the choice to copy
    near = _measure(80.0, 400.0).costs()
    assert choose_service(near, 8)[0] == "hybrid"
    assert choose_service(near, 8, idle_us=400.0)[0] == "copy"
    assert "with the hand-off" in choose_service(near, 8, idle_us=2.0)[1]
    # with a tail the hybrid prediction prices the table that will run: never above whole experts' (beyond
    # the tie), and the line says how many rows of a served expert the link takes
    balanced = _measure(80.0, 90.0, cpu_fixed=40.0).costs()
    whole, tail = choose_service(balanced, 8), choose_service(balanced, 8, 0.0, 768, 64)
    assert "rows of a served expert's 768" in tail[1] and "rows" not in whole[1]

    def hybrid_us(why: str) -> float:
        return float(why.split("hybrid ")[1].split(" us")[0])
    assert hybrid_us(tail[1]) <= hybrid_us(whole[1]) * (1 + TAIL_TIE)


def test_the_round_trip_is_the_cpus_fixed_part():
    """Paid only by a call the CPU serves: in the CPU's fixed cost, so the table copies every miss of a
    call where splitting would not repay it."""
    cheap, dear = (dataclasses.replace(_measure(80.0, 100.0, cpu_fixed=0.0), handoff_us=h) for h in (0.0, 500.0))
    assert cheap.costs().cpu_fixed_us == pytest.approx(0.0) and dear.costs().cpu_fixed_us == pytest.approx(500.0)
    assert MissSplit.hybrid(cheap.costs()).copies_for(2) == 1
    assert MissSplit.hybrid(dear.costs()).copies_for(2) == 2 and MissSplit.hybrid(dear.costs()).copies_for(8) < 8
    assert "round trip of 500.0 beyond the 0.0 us" in dear.describe()
    # the launches every call pays (idle_us, charged by choose_service) are not counted again
    assert dataclasses.replace(dear, idle_us=30.0).costs().cpu_fixed_us == pytest.approx(470.0)
    assert dataclasses.replace(cheap, idle_us=30.0).costs().cpu_fixed_us == pytest.approx(0.0)


def test_the_table_balances_the_together_rates():
    costs = _measure(80.0, 160.0, link_fixed=0.0, cpu_fixed=0.0, link_slow=1.0, cpu_slow=1.0).costs()
    table = MissSplit.hybrid(costs)
    assert table.copies_for(6) == 4 and table.copies_for(3) == 2  # the link twice as fast: two thirds copied


@pytest.mark.parametrize("layers, experts, n, expert_mib", [(48, 128, 8, 9), (48, 128, 8, 2), (4, 8, 8, 1),
                                                          (3, 20, 6, 64), (2, 64, 8, 1)])
def test_the_rotation_reads_past_the_host_cache(layers, experts, n, expert_mib):
    """Each group n distinct experts of one layer, no expert in two groups, the layers in turn; the groups
    hold ROTATION_BYTES or every group the store has."""
    got_layers, got = rotation(layers, experts, n, expert_mib * MIB, np.random.default_rng(3))
    groups = len(got)
    assert got.shape == (groups, n) and got_layers.shape == (groups,)
    assert groups == min(-(-ROTATION_BYTES // (n * expert_mib * MIB)), layers * (experts // n))
    keys = got_layers[:, None].astype(np.int64) * experts + got
    assert len(np.unique(keys)) == keys.size  # distinct within and across groups
    assert ((got >= 0) & (got < experts)).all() and (np.diff(got, axis=1) > 0).all()
    assert list(got_layers[:min(groups, layers)]) == list(range(min(groups, layers)))
    with pytest.raises(ValueError, match="num_experts"):
        rotation(layers, 4, 8, MIB, np.random.default_rng(0))


def test_resolve_on_a_gpu_measures_once_and_logs_what_it_chose(caplog, monkeypatch):
    monkeypatch.setattr(cpu_experts, "_THREADS", [])
    calls = []

    def measure():
        calls.append(1)
        return _measure(80.0, 100.0)

    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        split = resolve_miss_service("auto", "cuda", measure=measure)
    assert split.service == "hybrid" and calls == [1]
    assert np.array_equal(split.copies, MissSplit.hybrid(_measure(80.0, 100.0).costs()).copies)
    assert "chose hybrid" in caplog.text and "GB/s" in caplog.text and "measured in 1.10 s" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moe.engine.loading"):
        split = resolve_miss_service("auto", "cuda", measure=lambda: _measure(80.0, 2000.0))
    assert split.copies_all and "chose copy" in caplog.text
    assert resolve_miss_service("hybrid", "cuda", measure=lambda: _measure(80.0, 2000.0)).service == "hybrid"
    assert resolve_miss_service("copy", "cuda", measure=lambda: pytest.fail("copy measures nothing")).copies_all
    assert resolve_miss_service("cpu", "cuda").service == "cpu"  # nothing to balance


def test_the_cpu_backend_measures_nothing():
    fail = lambda: pytest.fail("the CPU backend has no link to measure")  # noqa: E731
    assert resolve_miss_service("auto", "cpu", measure=fail).copies_all
    assert resolve_miss_service("hybrid", "cpu", measure=fail).copies_for(4) == 2


def test_measure_channels_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA"):
        measure_channels(None, None, "cpu")


def test_slots_for_every_expert_make_hybrid_and_auto_copy_without_measuring(monkeypatch):
    monkeypatch.setattr(cpu_experts, "_THREADS", [])
    fail = lambda: pytest.fail("nothing is measured when the slots hold every expert")  # noqa: E731
    for device in ("cpu", "cuda"):
        for service in ("hybrid", "auto"):
            got = choose_miss_service(service, device, measure=fail, fits_all=True)
            assert got.split.copies_all and "the slots hold every routed expert" in got.note
        assert choose_miss_service("cpu", device, cpu_threads=1, fits_all=True).split.service == "cpu"
    assert choose_miss_service("hybrid", "cpu", fits_all=False).split.service == "hybrid"


def test_split_for_slots_drops_only_a_hybrid_split_whose_slots_hold_every_expert():
    from expertcache.split import ChannelCosts, MissSplit, split_for_slots

    hybrid = MissSplit.hybrid(ChannelCosts(0.0, 1.0, 0.0, 1.0))
    assert split_for_slots(hybrid, 96, 96) is None and split_for_slots(hybrid, 95, 96) is hybrid
    assert split_for_slots(MissSplit.cpu(), 96, 96).service == "cpu"  # cpu admits nothing: it stays
    assert split_for_slots(None, 96, 96) is None


def test_each_resolution_says_what_was_chosen(monkeypatch):
    monkeypatch.setattr(cpu_experts, "_THREADS", [])
    notes = {s: choose_miss_service(s, "cpu", cpu_threads=1).note for s in ("copy", "hybrid", "cpu", "auto")}
    assert notes["copy"] == "--moe-miss-service copy: every miss copied into a slot"
    assert "half of each call" in notes["hybrid"] and "1 CPU threads" in notes["hybrid"]
    assert "every routed expert computed on the CPU" in notes["cpu"]
    assert notes["auto"].startswith("--moe-miss-service auto: copy (the CPU backend has no link")
    gpu = choose_miss_service("auto", "cuda", cpu_threads=1, measure=lambda: _measure(80.0, 100.0))
    assert gpu.split.service == "hybrid" and gpu.note.endswith("chose hybrid") and "GB/s" in gpu.note
