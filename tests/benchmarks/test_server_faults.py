"""The fault battery (benchmarks/server_faults.py) for a short while: a real `expertcache serve`
process, every bad case, 16 clients that disconnect at random, SIGTERM with requests open."""

from __future__ import annotations

from tests.conftest import load_bench


def test_the_fault_battery_passes():
    battery = load_bench("server_faults")
    result = battery.run(seconds=6, clients=16, model=None, max_rss_growth_mb=256)
    c = result["counts"]
    assert result["checks"]["passed"], result
    assert c["cases_tried"] >= len(battery._cases()) and c["disconnects"] > 0 and c["survived"] > 0
