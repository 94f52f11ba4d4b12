"""The fault battery (benchmarks/server_faults.py) for a short while: a real `expertcache serve`
process, every bad case, 16 clients that disconnect at random, SIGTERM with requests open."""

from __future__ import annotations

import pytest

from tests.conftest import load_bench


@pytest.mark.parametrize("service, seconds, clients", [("copy", 6, 16), ("hybrid", 4, 8)])
def test_the_fault_battery_passes(service, seconds, clients):
    """hybrid: the scheduler's thread computes part of every step's misses on the CPU kernels (the GIL
    released) while the server answers the bad cases and the clients."""
    battery = load_bench("server_faults")
    result = battery.run(seconds=seconds, clients=clients, model=None, max_rss_growth_mb=256, miss_service=service)
    assert result["miss_service"] == service
    c = result["counts"]
    failed = [k for k, ok in result["checks"].items() if not ok and k != "passed"]
    assert not failed, (f"failed checks {failed}; counts {c}; rss_mb {result['rss_mb']}; health {result['health']}; "
                        f"shutdown {result['shutdown']}; client errors {result['client_errors']}; "
                        f"failed cases {result['failed_cases']}\nserver log tail:\n{result['log_tail']}")
    assert c["cases_tried"] >= len(battery._cases()) and c["disconnects"] > 0 and c["survived"] > 0
