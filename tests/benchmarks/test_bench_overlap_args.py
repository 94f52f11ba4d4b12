"""benchmarks/bench_moe_copy_overlap.py's command line and summary lines (CPU: no timing): the bench
compares the overlap off and on under the plans the layers resolve, so it takes no launch options."""

from __future__ import annotations

import pytest

from moe.kernels.plan import resolve_launch_plan
from tests.conftest import load_bench


def _bench():
    return load_bench("bench_moe_copy_overlap")


def test_marginal_from_is_checked_against_the_layers(capsys):
    bench = _bench()
    args = bench.parse(["--out-dir", "x", "--layers", "12", "--marginal-from", "4", "--no-miss-mode"])
    assert (args.layers, args.marginal_from, args.miss_mode) == (12, 4, False)
    assert bench.parse(["--out-dir", "x"]).marginal_from is None
    for bad in ("0", "12", "13"):
        with pytest.raises(SystemExit):
            bench.parse(["--out-dir", "x", "--layers", "12", "--marginal-from", bad])
        assert "--marginal-from must be in [1, --layers)" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--resident-variants", "--early-hits", "--front-release", "--hits-first",
                                    "--down-release", "--down-prefetch", "--copy-release", "--router-early",
                                    "--no-pdl-chain", "--compute-priority", "--hits-per-sm"])
def test_launch_options_are_gone(option, capsys):
    """The launch choices are the resolver's: the variant options of the bench are refused."""
    with pytest.raises(SystemExit):
        _bench().parse(["--out-dir", "x", option, "1"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_plan_line_names_the_mode_and_the_releases():
    bench = _bench()
    cfg = bench.CFG
    keys = 4 * cfg.num_experts
    full = resolve_launch_plan(cfg, num_slots=keys, num_keys=keys, device="cuda", num_sms=132, copy_overlap=True)
    misses = resolve_launch_plan(cfg, num_slots=1650, num_keys=keys, device="cuda", num_sms=132, copy_overlap=True)
    assert bench.plan_line(full.summary()) == ("shared_on_side (front_release, router_early_weights; "
                                               "down_prefetch 2)")
    assert bench.plan_line(misses.summary()) == "shared_and_hits_on_side (no release; down_prefetch 4)"


def test_marginal_line_names_the_layers_and_the_ratio():
    timing = {m: {"median_us": v, "p10_us": v - 0.5, "p90_us": v + 0.5} for m, v in (("off", 30.0), ("on", 24.0))}
    r = {"settings_layers": 12, "marginal": {"from_layer": 4, "timing": timing,
                                             "ratio_to_floor": {"off": 30 / 16.8, "on": 24 / 16.8}}}
    line = _bench().marginal_line(r)
    assert "layers 4..11 of 12" in line and "on 24.0 us (1.43x) [p10 23.5, p90 24.5]" in line
