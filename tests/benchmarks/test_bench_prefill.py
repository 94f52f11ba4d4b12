"""benchmarks/bench_prefill.py on the CPU: the routing that fills a quarter of the slots, the copy-engine
limit, the command line."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_bench


def _bench():
    return load_bench("bench_prefill")


@pytest.mark.parametrize("layers, experts, k, slots", [(8, 128, 8, 256), (3, 16, 4, 30), (2, 64, 8, 10)])
def test_the_fill_routing_routes_each_layer_to_its_first_experts_k_distinct_a_step(layers, experts, k, slots):
    ids = _bench().resident_routing(layers, experts, k, slots)
    assert ids.dtype == np.int32 and ids.shape[1:] == (layers, 1, k)
    for step in ids:
        for layer in step:
            assert len(set(layer[0].tolist())) == k  # k distinct experts a row
    per_layer = min(experts, slots // layers)
    if per_layer >= k:
        assert {int(e) for e in np.unique(ids)} == set(range(per_layer))  # exactly the first slots / L experts
        assert len(np.unique(ids)) * layers <= slots  # all of them fit the cache


def test_the_copy_limit_is_the_streamed_bytes_at_the_link_speed():
    assert _bench().copy_limit(100, 9_437_184, 55e9) == pytest.approx(100 * 9_437_184 / 55e9)
    assert _bench().copy_limit(0, 9_437_184, 55e9) == 0


@pytest.mark.parametrize("argv, message", [(["--prompts", "1k"], "--prompts: '1k'"),
                                           (["--prompts", "0"], "must be >= 1"),
                                           (["--slots-frac", "0"], "--slots-frac must be in (0, 1]"),
                                           (["--expert-format", "int3"], "--expert-format: invalid choice")])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench().parse(argv)
    assert message in capsys.readouterr().err


def test_defaults():
    args = _bench().parse([])
    assert (args.layers, args.prompts, args.slots_frac, args.prefill_chunk) == (8, [1024, 8192, 32768], 0.25, 16384)
    assert args.expert_format is None and _bench().parse(["--expert-format", "int4"]).expert_format == "int4"
