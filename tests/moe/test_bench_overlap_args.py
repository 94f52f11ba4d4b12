"""benchmarks/bench_moe_copy_overlap.py's resident variants: each part sets its option, unknown parts
are refused by name (CPU: the parser only)."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import load_bench


def _bench():
    return load_bench("bench_moe_copy_overlap")


def _base() -> argparse.Namespace:
    return argparse.Namespace(early_hits=None, pdl_chain=True, hits_first=False, compute_priority=None,
                              hits_per_sm=None, down_release=False, router_early=False, down_prefetch=None,
                              front_release=None, copy_release=None)


def test_variant_parts_set_their_options():
    bench = _bench()
    base = _base()
    name, opts = bench.resident_variant("noeh+dr+rw+pf2+re8+rwarps8", base)
    assert name == "noeh+dr+rw+pf2+re8+rwarps8"
    assert (opts.early_hits, opts.down_release, opts.router_early, opts.down_prefetch) == (False, True, True, 2)
    assert opts.router_tiles == {"block_e": 8, "warps": 8}
    assert opts.router_select is None
    assert base.early_hits is None and not base.down_release  # the base namespace is left as it was
    _, plain = bench.resident_variant("rtopk", base)
    assert plain.router_tiles == {} and plain.router_select == "topk"
    _, old = bench.resident_variant("eh+nofr", base)
    assert (old.early_hits, old.front_release) == (True, False)
    _, fr = bench.resident_variant("fr", base)
    assert fr.front_release is True and fr.early_hits is None
    _, nocr = bench.resident_variant("nocr", base)
    assert nocr.copy_release is False and base.copy_release is None
    assert bench.resident_variant("cr", base)[1].copy_release is True


@pytest.mark.parametrize("bad", ["re", "rex", "rwarps", "bogus", "noeh+pfx", "frx", "crx"])
def test_unknown_variant_part_is_refused_by_name(bad):
    bench = _bench()
    with pytest.raises(SystemExit, match="resident-variants"):
        bench.resident_variant(bad, _base())


def test_marginal_from_is_checked_against_the_layers(capsys):
    bench = _bench()
    args = bench.parse(["--out-dir", "x", "--layers", "12", "--marginal-from", "4"])
    assert (args.layers, args.marginal_from) == (12, 4)
    assert bench.parse(["--out-dir", "x"]).marginal_from is None
    for bad in ("0", "12", "13"):
        with pytest.raises(SystemExit):
            bench.parse(["--out-dir", "x", "--layers", "12", "--marginal-from", bad])
        assert "--marginal-from must be in [1, --layers)" in capsys.readouterr().err


def test_launch_defaults_follow_the_options():
    bench = _bench()
    import moe.kernels.routed
    import moe.kernels.router
    saved = (moe.kernels.routed.DEFAULT_CONFIG, moe.kernels.router.DEFAULT_ROUTER, moe.kernels.routed.HITS_PROGRAMS_PER_SM)
    try:
        _, opts = bench.resident_variant("nocr+dr+pf2+rw+re8+rtopk+hits4", _base())
        bench.set_launch_defaults(opts)
        routed, router = moe.kernels.routed.DEFAULT_CONFIG, moe.kernels.router.DEFAULT_ROUTER
        assert (routed.copy_release, routed.down_release, routed.down_prefetch) == (False, True, 2)
        assert (router.early_weights, router.block_e, router.select) == (True, 8, "topk")
        assert moe.kernels.routed.HITS_PROGRAMS_PER_SM == 4
        bench.set_launch_defaults(_base())  # the command line's namespace: no router tiles or select
        assert moe.kernels.routed.DEFAULT_CONFIG == bench.DEFAULT_ROUTED
        assert moe.kernels.router.DEFAULT_ROUTER.early_weights is False and moe.kernels.router.DEFAULT_ROUTER.block_e is None
        assert moe.kernels.routed.HITS_PROGRAMS_PER_SM == bench.DEFAULT_HITS_PER_SM
    finally:
        moe.kernels.routed.DEFAULT_CONFIG, moe.kernels.router.DEFAULT_ROUTER, moe.kernels.routed.HITS_PROGRAMS_PER_SM = saved


def test_repeated_variants_keep_every_run():
    bench = _bench()
    runs = {}
    for spec in ("noeh", "cr", "noeh", "noeh"):
        runs[bench.variant_key(runs, spec)] = spec
    assert list(runs) == ["noeh", "cr", "noeh#2", "noeh#3"]


def test_marginal_line_names_the_layers_and_the_ratio():
    timing = {m: {"median_us": v, "p10_us": v - 0.5, "p90_us": v + 0.5} for m, v in (("off", 30.0), ("on", 24.0))}
    r = {"settings_layers": 12, "marginal": {"from_layer": 4, "timing": timing,
                                             "ratio_to_floor": {"off": 30 / 16.8, "on": 24 / 16.8}}}
    line = _bench().marginal_line(r)
    assert "layers 4..11 of 12" in line and "on 24.0 us (1.43x) [p10 23.5, p90 24.5]" in line
