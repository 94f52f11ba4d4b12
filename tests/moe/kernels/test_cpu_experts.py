"""CpuExperts (numba, on the CPU, from a HostStore) against a float64 torch reference of the formats' decode.

Legend: T = tokens, H = hidden, I = expert width, k = top_k, E = experts a layer, L = MoE layers. Every
store holds random experts quantized with the format's own `quantize` (moe.testing.synthetic); the
reference decodes each expert with resolve_format(key).decode and computes the routed sum in float64.
"""

import gc
import threading

import numpy as np
import pytest
import torch

from expertcache.formats import bank_name, resolve_format
from expertcache.split import tail_granule
from moe.kernels.cpu_experts import MAX_TOKENS, SPIN_PAUSES, CpuExperts, set_threads
from moe.model.config import EXPERT_BIAS_BANKS, MoEConfig
from moe.model.reference import gated_activation
from moe.testing.synthetic import random_weights

FORMATS = ("bf16", "fp8", "int4", "int4-f16-z", "nvfp4", "mxfp4")
H, I, E, L, K = 288, 96, 5, 2, 4  # H / I: partial int4 and fp8 groups, whole mxfp4 blocks
_stores: dict = {}


def make_experts(fmt: str, activation: str = "silu", hidden: int = H, inter: int = I, dtype: str = "bfloat16"):
    """(cfg, store) of L layers of E random experts in `fmt` (with biases for swiglu_clamped); int4 zero points
    random in 0..15 rather than the quantizer's 8. Made once per arguments."""
    args = (fmt, activation, hidden, inter, dtype)
    if args not in _stores:
        cfg = MoEConfig(hidden=hidden, num_experts=E, top_k=K, expert_intermediate=inter, expert_format=fmt,
                        activation=activation, expert_bias=activation == "swiglu_clamped", dtype=dtype)
        store = random_weights(cfg, L, device="cpu", seed=len(_stores), pin=False).store
        g = torch.Generator().manual_seed(7)
        for name in ("gate_up.z", "down.z"):
            if name in {b.name for b in store.banks}:
                z = store.tensor(name)
                z.copy_(torch.randint(0, 16, z.shape, generator=g, dtype=torch.uint8))
        _stores[args] = cfg, store
    return _stores[args]


_experts_f64: dict = {}


def expert_f64(cfg: MoEConfig, store, key: int):
    """(gate_up [2I, H], down [H, I], b_gate_up, b_down) float64 of key `key` through the format's decode."""
    if (id(store), key) not in _experts_f64:
        _experts_f64[id(store), key] = _decode_f64(cfg, store, key)
    return _experts_f64[id(store), key]


def _decode_f64(cfg: MoEConfig, store, key: int):
    fmt, h, i = resolve_format(cfg.expert_format), cfg.hidden, cfg.expert_intermediate

    def decode(name, rows, cols, stack):
        parts = {p.suffix: store.tensor(bank_name(name, p.suffix))[key] for p in fmt.layout(rows, cols, stack)}
        return fmt.decode(parts, rows, cols, stack).double()

    biases = [store.tensor(b)[key].double() if cfg.expert_bias else None for b in EXPERT_BIAS_BANKS]
    return decode("gate_up", 2 * i, h, 2), decode("down", h, i, 1), *biases


def reference(cfg: MoEConfig, store, layer: int, x, ids, weights, split=None) -> torch.Tensor:
    """out [T, H] float64 = Σ_{j ascending, ids >= 0} weights[t, j] * expert(layer * E + ids[t, j])(x[t]); with
    split = (expert, cut) that expert's part of rows [0, cut): down[:, :cut] @ act(gate_up rows [0, cut) and
    [I, I + cut) of x + their biases), no down bias."""
    out = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                continue
            gu, dn, b_gu, b_dn = expert_f64(cfg, store, layer * cfg.num_experts + int(ids[t, j]))
            if split is not None and ids[t, j] == split[0]:
                inter, cut = cfg.expert_intermediate, split[1]
                rows = torch.cat([torch.arange(cut), inter + torch.arange(cut)])
                gu, dn, b_dn = gu[rows], dn[:, :cut], None
                b_gu = None if b_gu is None else b_gu[rows]
            h = gu @ torch.from_numpy(x[t]).double()
            a = gated_activation(h if b_gu is None else h + b_gu, cfg)
            y = dn @ a
            out[t] += float(weights[t, j]) * (y if b_dn is None else y + b_dn)
    return out


def routing(tokens: int, seed: int, experts: int = E):
    """(x [T, H], ids [T, k] int32 with some -1 and experts repeated across rows, weights [T, k]) float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    ids = np.stack([rng.permutation(experts)[:K] for _ in range(tokens)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    weights = rng.random((tokens, K)).astype(np.float32) + 0.1
    return x, ids, weights


def rel_err(out, ref) -> float:
    return float(torch.linalg.norm(torch.from_numpy(out).double() - ref) / torch.linalg.norm(ref))


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_the_float64_reference_of_the_formats_decode(fmt, activation, tokens):
    cfg, store = make_experts(fmt, activation)
    x, ids, weights = routing(tokens, seed=tokens)
    out = CpuExperts(store, cfg).moe(1, x, ids, weights)
    assert out.shape == (tokens, H) and out.dtype == np.float32
    assert rel_err(out, reference(cfg, store, 1, x, ids, weights)) < 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "int4-f16-z", "nvfp4", "float16", "float32"])
def test_row_tails_and_dense_formats(fmt):
    """H = 272, I = 80: rows that end in a partial chunk (the scalar tails) and partial scale groups."""
    cfg, store = make_experts(fmt, "swiglu_clamped", hidden=272, inter=80)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 272)).astype(np.float32)
    ids = np.array([[0, 4, -1, 2], [4, 1, 3, 0], [2, 2, -1, -1]], np.int32)  # row 2 names expert 2 twice
    weights = rng.random((3, K)).astype(np.float32)
    out = CpuExperts(store, cfg).moe(0, x, ids, weights)
    assert rel_err(out, reference(cfg, store, 0, x, ids, weights)) < 1e-5


def test_float32_model_biases():
    cfg, store = make_experts("float32", "swiglu_clamped", dtype="float32")
    x, ids, weights = routing(2, seed=5)
    out = CpuExperts(store, cfg).moe(0, x, ids, weights)
    assert rel_err(out, reference(cfg, store, 0, x, ids, weights)) < 1e-5


def test_rows_without_an_expert_are_zero_and_out_is_written_in_place():
    cfg, store = make_experts("nvfp4")
    x, ids, weights = routing(3, seed=11)
    ids[1] = -1
    out = torch.full((3, H), 5.0)  # a torch tensor, as pinned host memory would be
    result = CpuExperts(store, cfg).moe(0, x, ids, weights, out=out)
    assert np.shares_memory(result, out.numpy())
    assert bool((out[1] == 0).all())
    assert rel_err(out.numpy(), reference(cfg, store, 0, x, ids, weights)) < 1e-5


def test_out_may_be_x():
    cfg, store = make_experts("int4")
    x, ids, weights = routing(4, seed=12)
    experts = CpuExperts(store, cfg)
    want = experts.moe(1, x, ids, weights)
    experts.moe(1, x, ids, weights, out=x)
    assert np.array_equal(x, want)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


SPLIT_I = 384  # every format splits: granule 16 (bf16, nvfp4), 32 (mxfp4), 128 (fp8, int4: cuts 128 and 256)


def split_cuts(cfg: MoEConfig) -> tuple[int, int]:
    """The smallest and the largest cut of cfg's experts."""
    granule = tail_granule(cfg.format, cfg.expert_intermediate)
    assert 0 < granule < cfg.expert_intermediate
    return granule, cfg.expert_intermediate - granule


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_split_expert_computes_its_first_rows_without_the_down_bias(fmt, activation, tokens):
    """The most routed expert with the smallest cut, the first routed one (unit 0, planned last) with the
    largest; the other experts whole."""
    cfg, store = make_experts(fmt, activation, inter=SPLIT_I)
    x, ids, weights = routing(tokens, seed=50 + tokens)
    routed = ids[ids >= 0]
    smallest, largest = split_cuts(cfg)
    experts = CpuExperts(store, cfg)
    for split in ((int(np.bincount(routed).argmax()), smallest), (int(routed[0]), largest)):
        out = experts.moe(1, x, ids, weights, split=split)
        assert rel_err(out, reference(cfg, store, 1, x, ids, weights, split)) < 1e-5, split
        assert rel_err(out, reference(cfg, store, 1, x, ids, weights)) > 1e-4, split  # not the whole expert


def test_split_none_is_the_call_without_a_split():
    cfg, store = make_experts("nvfp4", "swiglu_clamped", inter=SPLIT_I)
    x, ids, weights = routing(MAX_TOKENS, seed=61)
    experts = CpuExperts(store, cfg)
    want = experts.moe(0, x, ids, weights)
    split = experts.moe(0, x, ids, weights, split=(int(ids[ids >= 0][0]), 16))
    assert not np.array_equal(split, want)
    assert np.array_equal(bits(experts.moe(0, x, ids, weights, split=None)), bits(want))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_split_is_bitwise_equal_for_any_thread_count(fmt):
    cfg, store = make_experts(fmt, "swiglu_clamped", inter=SPLIT_I)
    x, ids, weights = routing(MAX_TOKENS, seed=62)
    split = (int(ids[ids >= 0][0]), split_cuts(cfg)[0])
    experts = CpuExperts(store, cfg)
    try:
        results = []
        for n in (1, 2, 3):
            set_threads(n)
            results.append(experts.moe(1, x, ids, weights, split=split))
    finally:
        set_threads(None)
        experts.close()
    assert all(np.array_equal(bits(r), bits(results[0])) for r in results)


@pytest.mark.parametrize("fmt, split", [
    ("fp8", (2, 48)),  # not a multiple of the granule, 128
    ("fp8", (2, 0)),
    ("fp8", (2, SPLIT_I)),
    ("fp8", (2, -128)),
    ("fp8", (E, 128)),
    ("fp8", (-1, 128)),
    ("fp8", (4, 128)),  # not routed
    ("fp8", [2, 128]),
    ("fp8", (2,)),
    ("fp8", (2, 128.0)),
    ("fp8", (True, 128)),
    ("bf16", (2, 8)),
    ("int4", None),  # I = 96: fp8 / int4 experts that cannot be split (granule 0)
])
def test_bad_splits_are_refused_by_name_and_change_nothing(fmt, split):
    x = np.random.default_rng(0).standard_normal((3, H)).astype(np.float32)
    ids = np.array([[0, 2, -1, 1], [2, 3, 1, 0], [-1, -1, 3, 0]], np.int32)
    weights = np.ones((3, K), np.float32)
    out = np.full((3, H), 7.0, np.float32)
    if split is None:
        cfg, store = make_experts(fmt)
        assert tail_granule(cfg.format, I) == 0
        split = (2, 16)
    else:
        cfg, store = make_experts(fmt, inter=SPLIT_I)
    with pytest.raises(ValueError, match=r"\bsplit\b"):
        CpuExperts(store, cfg).moe(0, x, ids, weights, out=out, split=split)
    assert bool((out == 7).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_bitwise_equal_for_any_thread_count(fmt):
    cfg, store = make_experts(fmt, "swiglu_clamped")
    x, ids, weights = routing(MAX_TOKENS, seed=21)
    experts = CpuExperts(store, cfg)
    try:
        results = []
        for n, spin in ((1, 0), (2, 0), (4, 0), (3, SPIN_PAUSES), (1, SPIN_PAUSES)):
            set_threads(n)
            experts.spin_pauses = spin
            results.append(experts.moe(1, x, ids, weights))
    finally:
        set_threads(None)
        experts.close()
    eq = [np.array_equal(bits(r), bits(results[0])) for r in results]
    assert all(eq), (eq, [float(np.abs(r - results[0]).max()) for r in results])


def test_back_to_back_calls_of_different_sizes_on_spinning_threads():
    """Calls of 1 to 8 tokens (1 to 20 units) one after another on 4 threads that stay awake between them:
    each equals the same call on one thread (a thread of a past call that took an item of the next, or a
    down item before its gate_up rows were all written, would differ)."""
    cfg, store = make_experts("int4", "silu")
    experts = CpuExperts(store, cfg)
    calls = [routing(1 + i % MAX_TOKENS, seed=100 + i) for i in range(24)]
    try:
        set_threads(1)
        want = [experts.moe(i % L, *c) for i, c in enumerate(calls)]
        set_threads(4)
        experts.spin_pauses = SPIN_PAUSES
        for _ in range(8):
            for i, c in enumerate(calls):
                assert np.array_equal(bits(experts.moe(i % L, *c)), bits(want[i]))
    finally:
        set_threads(None)
        experts.close()


def _pool_threads() -> int:
    return sum(t.name.startswith("expertcache-cpu-experts") for t in threading.enumerate())


def test_pool_threads_are_joined_on_close_and_when_the_experts_are_collected():
    cfg, store = make_experts("bf16", "silu")
    x, ids, weights = routing(2, seed=5)
    before = _pool_threads()
    set_threads(3)
    try:
        experts = CpuExperts(store, cfg)
        experts.moe(0, x, ids, weights)
        assert _pool_threads() == before + 2
        experts.close()
        assert _pool_threads() == before
        experts.moe(0, x, ids, weights)  # a later call starts them again
        assert _pool_threads() == before + 2
        experts.spin_pauses = SPIN_PAUSES
        experts.moe(0, x, ids, weights)
        del experts
        gc.collect()
        # joined by then, still spinning as they were: one left to end inside its kernel while the
        # interpreter finalizes would abort the process
        assert _pool_threads() == before
    finally:
        set_threads(None)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4-f16-z", "nvfp4", "mxfp4", "float32"])
def test_views_share_the_stores_memory(fmt):
    cfg, store = make_experts(fmt, "swiglu_clamped")
    experts = CpuExperts(store, cfg)
    views = [v for m in (experts.gate_up, experts.down) for v in m[2:]]
    for bank in store.banks:
        host = store.tensor(bank.name).view(torch.uint8).numpy()
        shared = [v for v in views if np.shares_memory(v, host)]
        assert len(shared) == 1 and shared[0].nbytes == host.nbytes, bank.name


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "x": a["x"].astype(np.float64)}, "x"),
    (lambda a: {**a, "x": a["x"][:, :-1].copy()}, "x"),
    (lambda a: {**a, "x": np.zeros((MAX_TOKENS + 1, H), np.float32)}, "x"),
    (lambda a: {**a, "ids": np.where(a["ids"] == 3, E, a["ids"]).astype(np.int32)}, "ids"),
    (lambda a: {**a, "ids": np.full_like(a["ids"], -2)}, "ids"),
    (lambda a: {**a, "ids": a["ids"].astype(np.int64)}, "ids"),
    (lambda a: {**a, "weights": a["weights"][:, :2].copy()}, "weights"),
    (lambda a: {**a, "out": np.zeros((3, H + 1), np.float32)}, "out"),
    (lambda a: {**a, "layer": L}, "layer"),
])
def test_bad_inputs_are_refused_by_name_and_change_nothing(change, name):
    cfg, store = make_experts("fp8")
    x, ids, weights = routing(3, seed=31)
    ids[0, 0] = 3
    args = change({"layer": 0, "x": x, "ids": ids, "weights": weights, "out": np.full((3, H), 7.0, np.float32)})
    before = {k: np.copy(v) for k, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        CpuExperts(store, cfg).moe(**args)
    assert all(np.array_equal(args[k], v) for k, v in before.items())


def test_a_store_of_another_format_or_shape_is_refused():
    cfg, store = make_experts("fp8")
    with pytest.raises(ValueError, match="MoEConfig.expert_format='int4'"):
        CpuExperts(store, MoEConfig(hidden=H, num_experts=E, top_k=K, expert_intermediate=I, expert_format="int4"))
    with pytest.raises(ValueError, match="expert_intermediate=64"):
        CpuExperts(store, MoEConfig(hidden=H, num_experts=E, top_k=K, expert_intermediate=64, expert_format="fp8"))
    with pytest.raises(ValueError, match="num_experts=3"):
        CpuExperts(store, MoEConfig(hidden=H, num_experts=3, top_k=2, expert_intermediate=I, expert_format="fp8"))


@pytest.mark.parametrize("cols", [1, 96, 128, 288, 384, 2880])
def test_the_packed_input_order_is_a_permutation_of_whole_chunks(cols):
    """chunk_place moves inputs only within whole 128-input chunks (word l's nibble k: input 8l + k to 16k + l)
    and leaves the rest in place."""
    from moe.kernels.cpu_decode import chunk_place

    places = np.array([chunk_place(i, cols) for i in range(cols)])
    assert sorted(places) == list(range(cols))
    full = cols // 128 * 128
    assert (places[full:] == np.arange(full, cols)).all()
    i = np.arange(full)
    assert (places[:full] == i // 128 * 128 + (i % 8) * 16 + i % 128 // 8).all()
    assert (places[:full] // 128 == i // 128).all()


@pytest.mark.parametrize("fmt, hidden, inter", [("int4-f16-z", 2048, 768), ("nvfp4", 2048, 768),
                                                pytest.param("mxfp4", 2880, 2880, marks=pytest.mark.slow)])
def test_wide_packed_rows_match_the_reference(fmt, hidden, inter):
    """Rows of many whole chunks: Qwen3-30B-A3B's expert (H = 2048, I = 768), gpt-oss's (2880: 22 chunks and a
    partial one), 1 and 5 tokens."""
    cfg, store = make_experts(fmt, "swiglu_clamped", hidden=hidden, inter=inter)
    rng = np.random.default_rng(hidden)
    for tokens in (1, 5):
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(tokens)]).astype(np.int32)
        weights = rng.random((tokens, K)).astype(np.float32)
        out = CpuExperts(store, cfg).moe(0, x, ids, weights)
        assert rel_err(out, reference(cfg, store, 0, x, ids, weights)) < 1e-5, tokens


def test_a_format_or_activation_without_a_kernel_is_refused_by_field(monkeypatch):
    """Guards for formats and activations added after these kernels: named by their MoEConfig field."""
    import moe.kernels.cpu_experts as cpu_experts

    cfg, store = make_experts("mxfp4")
    monkeypatch.setattr(cpu_experts, "CODES", {k: v for k, v in cpu_experts.CODES.items() if k != "mxfp4"})
    with pytest.raises(ValueError, match="MoEConfig.expert_format='mxfp4'"):
        CpuExperts(store, cfg)
    monkeypatch.undo()
    cfg = MoEConfig(hidden=H, num_experts=E, top_k=K, expert_intermediate=I, expert_format="mxfp4")
    object.__setattr__(cfg, "activation", "gelu")  # MoEConfig refuses it; a later activation would pass
    with pytest.raises(ValueError, match="MoEConfig.activation='gelu'"):
        CpuExperts(store, cfg)


@pytest.mark.parametrize("value, word, want", [(np.float32(1.5), 0, 1.5), (0x4020, 0, 2.5), (0x4280, 1, 3.25)])
def test_as_f32_reads_a_dense_element_by_its_word(value, word, want):
    from moe.kernels.cpu_dots import as_f32

    assert as_f32(value, word) == np.float32(want)


def test_the_e2m1_permute_decode_follows_the_kernels_target():
    from expertcache.numba_cache import target_features
    from moe.kernels.cpu_decode import E2M1_TABLE, PERMUTE

    assert PERMUTE == ("avx512f" in target_features())
    # the table is the half-precision move's values: code (s, e, m) -> value / 2^14
    half = [np.array([((c & 7) << 9) | ((c & 8) << 12)], np.uint16).view(np.float16)[0] for c in range(16)]
    assert [float(v) for v in half] == list(E2M1_TABLE)


@pytest.mark.parametrize("kind", ["fp8", "int4", "nvfp4", "mxfp4"])
def test_each_chunk_step_prefetches_ahead_of_its_bytes(kind):
    """Every chunk step (one input and four), compiled afresh, asks for a line PREFETCH_BYTES ahead of its
    bytes (fp8's two lines): the packed formats otherwise stall on memory. It changes no value (the float64
    reference tests above run through it), and its results equal a call's without it."""
    from numba import njit

    from moe.kernels import cpu_decode
    from moe.kernels.cpu_decode import PREFETCH_BYTES

    one, four = getattr(cpu_decode, f"{kind}_chunk"), getattr(cpu_decode, f"{kind}_chunk4")
    q, x, acc = np.arange(512, dtype=np.uint8), np.ones(256, np.float32), np.zeros(16, np.float32)
    if kind == "int4":
        s, si = np.float32(0.5), np.float32(8.0)  # the group's scale and zero point
    else:
        s, si = (np.ones(4, np.float32) if kind == "fp8" else np.full(16, 56, np.uint8)), 0

    def step1(q, s, si, x, acc):
        one(q, 0, s, si, x, 0, acc)

    def step4(q, s, si, x, acc):
        four(q, 0, s, si, x, x, x, x, 0, acc, acc, acc, acc)

    lines = 2 if kind == "fp8" else 1
    for step in (step1, step4):
        fresh = njit(cache=False)(step)
        fresh(q, s, si, x, acc)
        ir = next(iter(fresh.inspect_llvm().values()))
        assert ir.count("call void @llvm.prefetch") == lines, f"{kind} {step.__name__}: no line asked for ahead"
        assert f"i64 {PREFETCH_BYTES}" in ir


def test_the_e2m1_decode_without_avx512_matches_the_reference(tmp_path):
    """The kernels compiled for an AVX2 target (no vpermps over 16 floats: the half-precision move decodes
    the codes) in a child process, against the same float64 reference."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CACHE_DIR": str(tmp_path),
           "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+sse4.1,+ssse3,+lzcnt,+movbe"}
    code = ("import moe.kernels.cpu_decode as d; assert not d.PERMUTE, 'the avx512 path was chosen'; "
            "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            "'tests/moe/kernels/test_cpu_experts.py', '-k', "
            "'float64_reference and (nvfp4 or mxfp4) and silu'"
            "]))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "6 passed" in run.stdout, run.stdout[-2000:]
