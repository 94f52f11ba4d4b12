"""The fault battery (benchmarks/server_faults.py) for a short while: a real `expertcache serve`
process, every bad case, 16 clients that disconnect at random, SIGTERM with requests open."""

from __future__ import annotations

from tests.conftest import load_bench


def test_the_fault_battery_passes():
    battery = load_bench("server_faults")
    result = battery.run(seconds=6, clients=16, model=None, max_rss_growth_mb=256)
    c = result["counts"]
    failed = [k for k, ok in result["checks"].items() if not ok and k != "passed"]
    assert not failed, (f"failed checks {failed}; counts {c}; rss_mb {result['rss_mb']}; health {result['health']}; "
                        f"shutdown {result['shutdown']}; client errors {result['client_errors']}; "
                        f"failed cases {result['failed_cases']}\nserver log tail:\n{result['log_tail']}")
    assert c["cases_tried"] >= len(battery._cases()) and c["disconnects"] > 0 and c["survived"] > 0
