"""`expertcache sim --moe-cache-gb G --expert-format F,...`: slots per format at one VRAM budget,
misses priced at each format's bytes, the flags' errors, and the old report without the flags."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

from expertcache.formats import GIB, format_names, get_format, slots_for_budget
from moe.cli import main
from sim.budget import pricing_shape
from sim.cli import PROFILES
from sim.costmodel import estimate_decode
from sim.importers import export_freetoken_dir, import_freetoken_dir
from sim.replay import min_slots, replay
from sim.synthetic import PRESETS, SyntheticConfig, generate, preset
from sim.trace import TraceError, TraceMeta, load_trace, save_trace

H, I = 256, 128  # a small expert: bf16 196,608 bytes
SMALL = SyntheticConfig(6, 32, 4, 300, seed=3, hidden_size=H, moe_intermediate_size=I,
                        expert_bytes=3 * H * I * 2, model="synthetic:small")
KEYS = 6 * 32
BUDGETS = (0.002, 0.004, 0.008)  # GiB: bf16 10 / 21 / 43 slots ... int4 169; every format fits at 0.02


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "small.npz"
    save_trace(generate(SMALL), path)
    return str(path)


@pytest.fixture(scope="module")
def no_shape(tmp_path_factory):
    """The same routing with neither meta shape keys nor expert_bytes."""
    path = tmp_path_factory.mktemp("budget") / "no-shape.npz"
    save_trace(generate(replace(SMALL, hidden_size=None, moe_intermediate_size=None,
                                expert_bytes=None)), path)
    return str(path)


def run_json(capsys, *argv) -> list[dict]:
    assert main(["sim", *argv, "--json", "--workers", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def sim_error(*argv) -> str:
    with pytest.raises(SystemExit) as err:
        main(["sim", *argv, "--workers", "1"])
    assert isinstance(err.value.code, str) and err.value.code.startswith("error: ")
    return err.value.code


def test_slots_per_format_are_slots_for_budget(capsys, small):
    rows = run_json(capsys, small, "--moe-cache-gb", ",".join(map(str, BUDGETS)),
                    "--expert-format", ",".join(format_names()), "--policies", "lru")
    assert [(r["moe_cache_gb"], r["format"]) for r in rows] == [
        (g, f) for g in BUDGETS for f in format_names()]
    for r in rows:
        fmt = get_format(r["format"])
        assert r["expert_bytes"] == fmt.expert_bytes(H, I)
        assert r["slots"] == slots_for_budget(r["moe_cache_gb"], fmt, H, I) < KEYS
        assert r["slots_gib"] == pytest.approx(r["slots"] * r["expert_bytes"] / GIB)
        assert r["slots_gib"] <= r["moe_cache_gb"] and r["all_experts_fit"] is False


def test_a_budget_holding_every_expert_reports_all_experts_fit(capsys, small):
    rows = run_json(capsys, small, "--moe-cache-gb", "0.02", "--expert-format", "nvfp4,bf16",
                    "--policies", "lru")
    nv, bf = rows
    assert slots_for_budget(0.02, get_format("nvfp4"), H, I) > KEYS
    assert (nv["slots"], nv["all_experts_fit"]) == (KEYS, True)
    assert nv["slots_gib"] == pytest.approx(KEYS * nv["expert_bytes"] / GIB) and nv["slots_gib"] < 0.02
    assert (bf["slots"], bf["all_experts_fit"]) == (slots_for_budget(0.02, get_format("bf16"), H, I), False)
    assert main(["sim", small, "--moe-cache-gb", "0.02", "--expert-format", "nvfp4,bf16",
                 "--policies", "lru", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert f" {KEYS}* " in out and "* all experts fit: 0.02 GiB" in out and "in nvfp4:" in out


def test_a_smaller_format_gets_more_slots_and_no_lower_hit_rate(capsys, small):
    rows = run_json(capsys, small, "--moe-cache-gb", ",".join(map(str, BUDGETS)),
                    "--expert-format", ",".join(format_names()), "--policies", "lru,belady")
    for gib in BUDGETS:
        for policy in ("lru", "belady"):
            mine = sorted((r for r in rows if r["moe_cache_gb"] == gib and r["policy"] == policy),
                          key=lambda r: -r["expert_bytes"])
            assert len(mine) == len(format_names())
            for big, little in zip(mine, mine[1:]):
                assert little["slots"] >= big["slots"]
                assert little["hit_rate"] >= big["hit_rate"]
                assert little["misses"] <= big["misses"]
                assert little["bytes_copied_per_token"] <= big["bytes_copied_per_token"]


def test_lru_and_belady_misses_never_rise_with_slots(small):
    trace = load_trace(small)
    for policy in ("lru", "belady"):
        misses = [replay(trace, policy, s).misses for s in range(min_slots(trace), KEYS + 1, 7)]
        assert all(b <= a for a, b in zip(misses, misses[1:])), policy


def test_bytes_per_token_is_misses_per_token_times_bytes_per_expert(capsys, small):
    rows = run_json(capsys, small, "--moe-cache-gb", "0.005", "--expert-format", ",".join(format_names()),
                    "--policies", "lru,rule")
    for r in rows:
        assert r["bytes_copied_per_token"] == pytest.approx(r["misses_per_token"] * r["expert_bytes"], rel=1e-12)
        assert r["mb_copied_per_token"] == pytest.approx(r["bytes_copied_per_token"] / 1e6, rel=1e-12)


def test_each_row_is_priced_at_its_formats_bytes(capsys, small):
    trace = load_trace(small)
    rows = run_json(capsys, small, "--expert-format", "fp8,nvfp4", "--slots", "40", "--policies", "lru")
    res = replay(trace, "lru", 40)
    for r in rows:
        nbytes = get_format(r["format"]).expert_bytes(H, I)
        est = estimate_decode(res.hist, res.tokens, pricing_shape(trace, (H, I), nbytes),
                              PROFILES["engine"])
        assert (r["misses"], r["moe_cache_gb"]) == (res.misses, None)  # one replay, two prices
        assert r["tokens_per_s"] == pytest.approx(est.tokens_per_s)
    assert rows[1]["tokens_per_s"] > rows[0]["tokens_per_s"]  # nvfp4 copies fewer bytes


def test_bf16_rows_price_exactly_as_the_plain_report(capsys, small):
    plain = run_json(capsys, small, "--slots", "40,80", "--policies", "lru,belady")
    bf16 = run_json(capsys, small, "--slots", "40,80", "--policies", "lru,belady", "--expert-format", "bf16")
    assert [{k: r[k] for k in p} for p, r in zip(plain, bf16)] == plain
    assert all(r["format"] == "bf16" and r["expert_bytes"] == 3 * H * I * 2 for r in bf16)


def test_the_default_format_with_a_budget_is_the_traces(capsys, tmp_path):
    fp8 = get_format("fp8").expert_bytes(H, I)
    path = tmp_path / "fp8.npz"
    save_trace(generate(replace(SMALL, expert_bytes=fp8)), path)
    rows = run_json(capsys, str(path), "--moe-cache-gb", "0.005", "--policies", "lru")
    assert [(r["format"], r["expert_bytes"]) for r in rows] == [("fp8", fp8)]
    rows = run_json(capsys, str(path), "--moe-cache-gb", "0.005", "--policies", "lru", "--expert-format", "bf16")
    assert [r["format"] for r in rows] == ["bf16"]


def test_expert_shape_flag_prices_a_trace_without_meta_shape(capsys, no_shape, small):
    flagged = run_json(capsys, no_shape, "--moe-cache-gb", "0.005", "--expert-format", "nvfp4,bf16",
                       "--expert-shape", f"{H},{I}", "--policies", "lru")
    meta = run_json(capsys, small, "--moe-cache-gb", "0.005", "--expert-format", "nvfp4,bf16", "--policies", "lru")
    assert [(r["slots"], r["misses"], r["tokens_per_s"]) for r in flagged] == [
        (r["slots"], r["misses"], r["tokens_per_s"]) for r in meta]


def test_per_layer_and_the_table_show_each_replay_once(capsys, small):
    assert main(["sim", small, "--expert-format", "nvfp4,bf16", "--slots", "40", "--policies", "lru",
                 "--per-layer", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "hidden 256, intermediate 128 (trace meta)" in out
    assert "     - nvfp4 " in out and "     - bf16 " in out
    header = next(line for line in out.splitlines() if line.startswith("layer"))
    assert header.split() == ["layer", "lru@40"]


@pytest.mark.parametrize("argv, needle", [
    (["--moe-cache-gb", "x"], "--moe-cache-gb takes comma-separated GiB"),
    (["--moe-cache-gb", ""], "--moe-cache-gb names nothing"),
    (["--moe-cache-gb", "0"], "--moe-cache-gb needs GiB > 0"),
    (["--moe-cache-gb", "-2"], "--moe-cache-gb needs GiB > 0"),
    (["--moe-cache-gb", "inf"], "--moe-cache-gb needs GiB > 0"),
    (["--moe-cache-gb", "1e-9"], "--moe-cache-gb 1e-09 holds no bf16 expert"),
    (["--moe-cache-gb", "0.0005"], "--moe-cache-gb 0.0005 holds 2 bf16 experts"),
    (["--moe-cache-gb", "8", "--slots", "40"], "--moe-cache-gb and --slots both"),
    (["--moe-cache-gb", "8", "--slots-frac", "0.5"], "--moe-cache-gb and --slots-frac both"),
    (["--expert-format", "nvfp5"], "--expert-format 'nvfp5' is unknown"),
    (["--expert-format", ","], "--expert-format names nothing"),
    (["--expert-shape", "256"], "--expert-shape takes H,I"),
    (["--expert-shape", "0,128"], "--expert-shape takes H,I"),
    (["--expert-shape", "a,b"], "--expert-shape takes H,I"),
    (["--expert-shape", "256,64", "--moe-cache-gb", "1"], "--expert-shape 256,64 differs from"),
])
def test_bad_flags_name_the_flag(small, argv, needle):
    assert needle in sim_error(small, "--policies", "lru", *argv)


def test_a_budget_below_the_largest_call_names_the_budget_to_give(small):
    per = get_format("bf16").expert_bytes(H, I)
    message = sim_error(small, "--moe-cache-gb", "0.0005")
    assert "fewer than the 4 distinct experts" in message and "give --moe-cache-gb >= " in message
    assert float(message.rsplit(">= ", 1)[1]) >= 4 * per / GIB


@pytest.mark.parametrize("argv", [["--moe-cache-gb", "1"], ["--expert-format", "fp8"],
                                  ["--expert-format", "bf16,int4", "--slots", "40"]])
def test_no_expert_shape_anywhere_names_expert_shape(no_shape, argv):
    message = sim_error(no_shape, *argv)
    assert "--expert-shape H,I" in message and "hidden_size, moe_intermediate_size" in message


def test_expert_shape_must_agree_with_meta_expert_bytes(tmp_path):
    path = tmp_path / "bytes.npz"
    save_trace(generate(replace(SMALL, hidden_size=None, moe_intermediate_size=None)), path)
    message = sim_error(str(path), "--moe-cache-gb", "1", "--expert-shape", "256,64")
    assert "meta.expert_bytes is 196,608 but --expert-shape 256,64 gives bf16 98,304" in message


def test_a_format_that_cannot_store_the_shape_names_expert_format(no_shape):
    message = sim_error(no_shape, "--expert-format", "nvfp4", "--expert-shape", "256,120", "--slots", "40")
    assert "--expert-format nvfp4" in message and "in_features=120 is not a multiple of 16" in message
    assert "--moe-expert-format" not in message


def test_meta_shape_keys_are_checked_on_load():
    meta = generate(SMALL).meta
    d = meta.to_dict()
    assert meta.expert_shape == (H, I) and (d["hidden_size"], d["moe_intermediate_size"]) == (H, I)
    cases = [
        ({"moe_intermediate_size": None}, "meta.hidden_size is set without meta.moe_intermediate_size"),
        ({"hidden_size": 0}, "meta.hidden_size must be an integer >= 1"),
        ({"moe_intermediate_size": 1.5}, "meta.moe_intermediate_size must be an integer >= 1"),
        ({"expert_bytes": 1000}, "meta.expert_bytes is 1,000, which no expert format gives"),
    ]
    for change, needle in cases:
        bad = {k: v for k, v in {**d, **change}.items() if v is not None}
        with pytest.raises(TraceError, match=needle):
            TraceMeta.from_dict(bad)
    for fmt in format_names():  # a trace recorded on a quantized model: its expert_bytes
        TraceMeta.from_dict({**d, "expert_bytes": get_format(fmt).expert_bytes(H, I)})
    TraceMeta.from_dict({**d, "expert_bytes": None})


def test_shape_keys_survive_save_and_the_freetoken_importer(tmp_path, small):
    t = load_trace(small)
    assert t.meta.expert_shape == (H, I)
    export_freetoken_dir(t, tmp_path / "ft")
    assert import_freetoken_dir(tmp_path / "ft").meta.expert_shape == (H, I)
    meta = json.loads((tmp_path / "ft" / "meta.json").read_text())
    meta["hidden_size"] = 512
    (tmp_path / "ft" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match="meta.expert_bytes is 196,608, which no expert format"):
        import_freetoken_dir(tmp_path / "ft")


def test_presets_write_their_expert_shape():
    assert PRESETS["qwen3-30b-a3b"].hidden_size == 2048 and PRESETS["qwen3-30b-a3b"].moe_intermediate_size == 768
    assert PRESETS["qwen3-next"].hidden_size == 2048 and PRESETS["qwen3-next"].moe_intermediate_size == 512
    assert PRESETS["mixtral"].hidden_size == 4096 and PRESETS["mixtral"].moe_intermediate_size == 14336
    for name in ("qwen3-30b-a3b", "qwen3-next", "mixtral"):
        cfg = PRESETS[name]
        assert cfg.expert_bytes == get_format("bf16").expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size)
        meta = generate(preset(name, num_tokens=2)).meta
        assert meta.expert_shape == (cfg.hidden_size, cfg.moe_intermediate_size)
    with pytest.raises(ValueError, match="give both or neither"):
        replace(SMALL, moe_intermediate_size=None)


# `expertcache sim --preset mixtral --tokens 60 --seed 4 --policies lru,rule,belady --slots 64,128
# --workers 1`, printed before --moe-cache-gb / --expert-format / --expert-shape existed (and the choice
# lines under it, added since, in their present wording; its header's counts with their digits grouped).
OLD_TABLE = """\
synthetic:mixtral, 60 tokens, 32 layers x 8 experts, top-2, batch 1, 3,840 accesses
cost model: nvidia-h200-sm-copy: H2D 1.7-6.3 MiB in 40.9-139.3 us, ceiling 50.2 GB/s, back-to-back 50.2 GB/s; \
HBM 4219 GB/s; layer overhead 20.3 us
policy     slots  %exp hit rate  miss/tok   MB/tok gap rec.    us/tok    tok/s tok/s ov
---------------------------------------------------------------------------------------
belady        64  25.0   0.5878     26.38   9295.4    1.000  191327.6      5.2      5.2
lru           64  25.0   0.3458     41.87  14750.5    0.000  300058.2      3.3      3.3
rule          64  25.0   0.3474     41.77  14715.3    0.006  299350.3      3.3      3.3
belady       128  50.0   0.7911     13.37   4709.4    1.000   99897.6     10.0     10.0
lru          128  50.0   0.5193     30.77  10839.8    0.000  222113.2      4.5      4.5
rule         128  50.0   0.6023     25.45   8966.6    0.306  184771.7      5.4      5.4
choice by modeled tok/s (no overlap), never an oracle; belady (knows the whole future) is the limit:
  64 slots (25.0 %): rule 3.3 tok/s, 1.002x lru's; limit: belady 5.2
  128 slots (50.0 %): rule 5.4 tok/s, 1.202x lru's; limit: belady 10.0

"""
OLD_JSON_SHA256 = "4152adeec89e5a91906a2cd2cb98a8be2f8e358fe481415796ab4601d96f77b0"  # same run, --json


def test_without_the_new_flags_the_output_is_the_old_one(capsys):
    argv = ["sim", "--preset", "mixtral", "--tokens", "60", "--seed", "4", "--policies", "lru,rule,belady",
            "--slots", "64,128", "--workers", "1", "--miss-service", "copy"]  # the miss services: test_service.py
    assert main(argv) == 0
    assert capsys.readouterr().out == OLD_TABLE
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    assert hashlib.sha256(out.encode()).hexdigest() == OLD_JSON_SHA256
    assert not {"format", "expert_bytes", "moe_cache_gb"} & set(json.loads(out)[0])
    assert np.isfinite([r["tokens_per_s"] for r in json.loads(out)]).all()
