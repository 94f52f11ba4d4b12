"""benchmarks/bench_routed.py's command line, config names, per-format floor and table (CPU: no timing)."""

from __future__ import annotations

import pytest

from expertcache.formats import get_format
from moe.kernels.plan import DEFAULT_ROUTED_TILES, QUANTIZED_ROUTED_TILES
from moe.kernels.tiles import RoutedTiles
from tests.conftest import load_bench


def _bench():
    return load_bench("bench_routed")


def test_defaults_cover_every_format_on_both_qwen_shapes():
    args = _bench().parse([])
    assert args.formats == ["bf16", "fp8", "nvfp4", "mxfp4", "int4"]
    assert args.shapes == ["qwen3-next", "qwen3-30b"]
    assert args.tokens == [1, 2, 4, 8]
    assert args.configs == ["default"]
    assert _bench().SHAPES["qwen3-30b"] == (2048, 768, 8, 512)


@pytest.mark.parametrize("argv, message", [
    (["--formats", "bf16,fp4"], "--formats: 'fp4' is not one of"),
    (["--shapes", "llama"], "--shapes: 'llama' is not one of"),
    (["--tokens", "0,1"], "--tokens: each in 1..64"),
    (["--tokens", "65"], "--tokens: each in 1..64"),
    (["--tokens", "16", "--mma", "none"], "--tokens above 8 run only the tensor-core kernels"),
    (["--tokens", "one"], "not a comma list of ints"),
])
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        _bench().parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bf16", "nvfp4", "int4"])
def test_read_calibration_streams_every_byte_of_the_slots_banks(name, monkeypatch):
    """stream_read over a pool's banks (values and scales, rows not a whole number of blocks) reads
    each pair's slot rows once: its per-block xors equal the words' own."""
    import torch

    bench = _bench()
    monkeypatch.setattr(bench, "READ_BLOCK", 64)
    g = torch.Generator().manual_seed(3)
    fmt = get_format(name)
    w = torch.randn(5, 96, 64, generator=g).bfloat16()
    matrix = w if name == "bf16" else bench.quantize_slots(fmt, w, 1)
    banks = bench.read_banks(matrix)
    assert sum(b.shape[1] * 4 for b in banks) == (w[0].numel() * 2 if name == "bf16" else fmt.matrix_bytes(96, 64))
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)
    blocks = bench.read_blocks(banks)
    out = torch.full((3 * blocks,), -1, dtype=torch.int32)
    bench.stream_read(banks, slots, out)
    want = []
    for s in slots.tolist():
        for b in banks:
            row = b[s]
            for first in range(0, row.numel(), 64):
                x = 0
                for v in row[first:first + 64].tolist():
                    x ^= v
                want.append(x)
    assert out.tolist() == want


def test_config_names_parse_and_refuse():
    bench = _bench()
    cfg = bench.parse_config("i4x1024w8-h8x512w4-dr-pf2")
    assert cfg.tiles == RoutedTiles(4, 1024, 8, 8, 512, 4)
    assert (cfg.down_release, cfg.down_prefetch, cfg.name) == (True, 2, "i4x1024w8-h8x512w4-dr-pf2")
    assert bench.parse_config(DEFAULT_ROUTED_TILES.name) == bench.DEFAULT
    for bad in ("i4x1024w8", "i3x1024w8-h8x512w4", "i4x1024w32-h8x512w4"):
        with pytest.raises(SystemExit, match="--configs"):
            bench.parse_config(bad)
    with pytest.raises(SystemExit, match="--configs"):
        bench.parse(["--configs", "default,nonsense"])


def test_default_and_named_configs_per_format():
    bench = _bench()
    bf16, nvfp4 = get_format("bf16"), get_format("nvfp4")
    assert [c.tiles for c in bench.format_configs(["default"], bf16)] == [DEFAULT_ROUTED_TILES]
    assert [c.tiles for c in bench.format_configs(["default"], nvfp4)] == [QUANTIZED_ROUTED_TILES]
    assert bench.format_configs(["default"], nvfp4)[0].down_prefetch is None  # quantized: no prefetch
    names = ["i4x1024w8-h8x512w4", "i4x1024w8-h8x512w4-pf2"]
    # bf16 keeps -pfN and always times its default (the speedup's baseline)
    assert [c.name for c in bench.format_configs(names, bf16)] == [DEFAULT_ROUTED_TILES.name, *names]
    # a quantized format prefetches nothing: the two names are one config there
    quant = bench.format_configs(names, nvfp4)
    assert [c.name for c in quant] == ["i4x1024w8-h8x512w4"] and quant[0].down_options["prefetch"] == 0


def test_sweep_names_every_tile_set_once_per_format():
    bench = _bench()
    names = bench.parse(["--configs", "sweep"]).configs
    assert names[0] == "default" and set(bench.SWEEP) | set(bench.QUANT_SWEEP) <= set(names)
    for fmt in ("bf16", "int4"):
        cfgs = bench.format_configs(names, get_format(fmt))
        assert len({c.name for c in cfgs}) == len(cfgs) == len(set(bench.SWEEP) | set(bench.QUANT_SWEEP))
        assert cfgs[0] == bench.default_config(get_format(fmt))


def test_floor_bytes_are_each_formats_own():
    bench = _bench()
    hid, inter = 2048, 768
    assert bench.call_bytes(get_format("bf16"), 8, hid, inter) == 8 * 3 * hid * inter * 2
    assert bench.call_bytes(get_format("nvfp4"), 8, hid, inter) == 8 * 2654220
    assert bench.call_bytes(get_format("fp8"), 2.5, hid, inter) == 2.5 * get_format("fp8").expert_bytes(hid, inter)
    assert bench.launch_shares(get_format("bf16"), hid, inter) == pytest.approx({"gate_up": 2 / 3, "down": 1 / 3})
    for name in ("fp8", "nvfp4", "mxfp4", "int4"):
        shares = bench.launch_shares(get_format(name), hid, inter)
        assert sum(shares.values()) == pytest.approx(1) and 0.6 < shares["gate_up"] < 0.7


def _row(fmt, config, us, floor, base, default=True, tokens=1, kernel="gemv", read2=None):
    return {"shape": "qwen3-30b", "format": fmt, "tokens": tokens, "config": config, "us_median": us, "kernel": kernel,
            "ratio_to_read2": None if read2 is None else us / read2,
            "us_min": us - 0.5, "us_max": us + 0.5, "floor_us": floor, "ratio_to_floor": us / floor, "gbps": 1000.0,
            "speedup_vs_bf16": base / us, "speedup_vs_torch": None, "default": default,
            "launches": {"gate_up": {"us_median": us * 0.6, "ratio_to_floor": 1.1},
                         "down": {"us_median": us * 0.4, "ratio_to_floor": 1.2}}}


def test_table_has_a_row_per_format_and_config_and_the_target_lines():
    bench = _bench()
    q = QUANTIZED_ROUTED_TILES.name
    rows = [_row("bf16", DEFAULT_ROUTED_TILES.name, 30.0, 25.0, 30.0),
            _row("nvfp4", q, 12.0, 7.0, 30.0), _row("nvfp4", "i4x1024w4-h8x512w4", 9.0, 7.0, 30.0, default=False)]
    for name, us in (("read1", 8.4), ("read2", 9.1)):
        row = _row("nvfp4", name, us, 7.0, 30.0, default=False, kernel=name)
        del row["launches"]
        rows.append(row)
    text = bench.table(rows)
    lines = text.splitlines()
    assert lines[0] == bench.TARGET
    body = [ln for ln in lines if ln.split()[:2] == ["qwen3-30b", "nvfp4"] and "alone" not in ln]
    assert [ln.split()[3] for ln in body] == ["read1", "i4x1024w4-h8x512w4", "read2", q]  # fastest first
    assert body[1].split()[-2:] == ["3.33x", "-"]  # vs bf16, vs torch
    assert f"T=1 qwen3-30b bf16: default {DEFAULT_ROUTED_TILES.name} 1.20x the floor (meets 1.3x)" in text
    assert (f"T=1 qwen3-30b nvfp4: default {q} 1.71x the floor (misses 1.3x); best i4x1024w4-h8x512w4 1.29x; "
            "read1 (bare streaming) 1.20x; read2 (bare streaming) 1.30x") in text


def test_mma_tiles_parse_and_refuse():
    bench = _bench()
    from moe.kernels.routed_mma import DEFAULT_MMA_TILES
    from moe.kernels.tiles import MmaTiles

    assert bench.parse([]).mma == [DEFAULT_MMA_TILES]
    assert bench.parse(["--mma", "none"]).mma == []
    sweep = bench.parse(["--mma", "sweep"]).mma
    assert sweep[0] == DEFAULT_MMA_TILES and len(sweep) == len(bench.MMA_SWEEP)
    assert [t.name for t in sweep] == list(bench.MMA_SWEEP)
    assert bench.parse_mma("m32-i64w8-h16w2-c128w4") == [MmaTiles(32, 64, 8, 16, 2, 128, 4)]
    for bad, message in (("m16-i32w4", "is not like"), ("m8-i32w4-h32w4-c256w2", "block_m must be >= 16")):
        with pytest.raises(SystemExit, match=f"--mma: .*{message}"):
            bench.parse_mma(bad)
    assert bench.parse(["--tokens", "1,64"]).tokens == [1, 64]


def test_mma_target_lines_against_read2_at_one_token_and_the_floor_from_eight():
    bench = _bench()
    rows = [_row("int4", "m16-i32w4-h32w4-c256w2", 11.0, 5.0, 30.0, kernel="mma", read2=10.0),
            _row("int4", QUANTIZED_ROUTED_TILES.name, 22.0, 5.0, 30.0),
            _row("int4", "m16-i32w4-h32w4-c256w2", 13.0, 10.0, 30.0, tokens=8, kernel="mma", read2=12.0),
            _row("int4", "m16-i32w4-h32w4-c256w2", 20.0, 10.0, 30.0, tokens=16, kernel="mma"),
            _row("int4", "m16-i32w4-h32w4-c256w2", 9.0, 8.0, 30.0, tokens=4, kernel="mma", read2=12.0),
            _row("bf16", "m16-i32w4-h32w4-c256w2", 9.0, 8.0, 30.0, kernel="mma", read2=12.0)]
    lines = bench.mma_targets(rows)
    assert lines == [
        bench.MMA_TARGET,
        "T=1 qwen3-30b int4: mma m16-i32w4-h32w4-c256w2 11.00 us, 1.10x read2 (meets 1.25x); one program a pair "
        f"{QUANTIZED_ROUTED_TILES.name} 22.00 us (2.00x the mma's time)",
        "T=8 qwen3-30b int4: mma m16-i32w4-h32w4-c256w2 13.00 us, 1.30x the floor (meets 1.3x)",
        "T=16 qwen3-30b int4: mma m16-i32w4-h32w4-c256w2 20.00 us, 2.00x the floor (misses 1.3x)",
    ]
    assert bench.mma_targets([rows[1]]) == []


def test_no_graphs_time_to_nothing():
    """Past GEMV_MAX_TOKENS only the tensor-core kernels run, and no launch is timed alone: an empty set of
    graphs gives no rows (not a division by zero)."""
    assert _bench().time_variants({}, calls=20, reps=5, warmup=1) == {}
