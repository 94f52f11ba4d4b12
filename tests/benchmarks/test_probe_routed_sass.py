"""benchmarks/probe_routed_sass.py: the loop finder on a listing, its options, and one compile of int4's
kernels for sm_90 (a child process without TRITON_INTERPRET; skipped without ptxas)."""

from __future__ import annotations

import pytest

from tests.conftest import compile_check, load_bench


def _probe():
    return load_bench("probe_routed_sass")


def test_the_innermost_loop_holding_the_mma_is_counted():
    code = [(0x00, "MOV R1, c[0x0][0x28]"),
            (0x10, "LDG.E R2, desc[UR4][R4.64]"),      # outer loop starts
            (0x20, "HMMA.16816.F32.BF16 R8, R12, R16, R8"),  # inner loop with the mma: 0x20..0x40
            (0x30, "LOP3.LUT R3, R2, 0xf, RZ, 0xc0, !PT"),
            (0x40, "@P0 BRA 0x20"),
            (0x50, "IADD3 R5, R5, 0x1, RZ"),
            (0x60, "@P1 BRA 0x10"),
            (0x70, "LOP3.LUT R6, R6, R7, RZ, 0xfc, !PT"),  # a loop without an mma: 0x70..0x80
            (0x80, "@P2 BRA 0x70"),
            (0x90, "EXIT")]
    probe = _probe()
    assert probe.innermost_loop(code, "HMMA") == [ins for a, ins in code if 0x20 <= a <= 0x40]
    assert probe.innermost_loop(code, "WGMMA") == []
    wgmma = [(a, ins.replace("HMMA.16816.F32.BF16 R8, R12, R16, R8", "HGMMA.64x16x16.F32.BF16 R8, R12, gdesc[UR4], R8"))
             for a, ins in code]
    assert probe.innermost_loop(wgmma, probe.MMA_OPCODES) == [ins for a, ins in wgmma if 0x20 <= a <= 0x40]
    assert probe._opcode("@!P0 LOP3.LUT R3, R2, 0xf, RZ, 0xc0, !PT") == "LOP3"


@pytest.mark.parametrize("argv, message", [
    (["--formats", "int4,fp4"], "--formats: 'fp4' is not one of"),
    (["--mma", "m16-i32w4"], "--mma: 'm16-i32w4' is not like"),
    (["--mma", "m8-i32w4-h64w4-c256w2"], "block_m must be >= 16"),
    (["--tokens", "65"], "--tokens must be in 1..64"),
])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        _probe().parse(argv)
    assert message in capsys.readouterr().err


RUN = """
import json, sys, tempfile
sys.path.insert(0, "benchmarks")
import probe_routed_sass
out = tempfile.mktemp(suffix=".json")
assert probe_routed_sass.main(["--formats", "int4", "--out", out]) == 0
print(json.dumps(json.load(open(out))))
"""


def test_int4_counts_per_kernel_and_launch():
    doc = compile_check(RUN)
    rows = {(r["kernel"].split()[0], r["launch"]): r for r in doc["rows"]}
    assert sorted(rows) == [("mma", "down"), ("mma", "gate_up"), ("pair", "down"), ("pair", "gate_up")]
    assert doc["settings"]["arch"] == "sm_90" and doc["settings"]["formats"] == ["int4"]
    for r in rows.values():
        assert r["per_weight"] == pytest.approx(r["instructions"] / r["weights_per_thread"])
        assert r["per_weight"] > 1 and isinstance(r["registers"], int) and r["opcodes"]
    # the tensor-core gate_up decodes each int4 code where its dot reads it: fewer issues a weight
    assert rows[("mma", "gate_up")]["per_weight"] < rows[("pair", "gate_up")]["per_weight"]
