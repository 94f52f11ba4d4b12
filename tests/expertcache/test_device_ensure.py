"""The device ensure against the host reference, bit for bit after every call.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (small cases; on a GPU they
run there). The launch's resolved choices, rule's score in int32 against int64, and the sm_90
compile checks (ptxas, no GPU) are here too; test_device_ensure_gpu.py holds the GPU-only tests (the
full grid of slot counts, k, rows and logits, eager and in CUDA graphs, and the real traces).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from expertcache import CacheGeometry, ChannelCosts, EnsureError, HostCache, MissSplit
from expertcache.device.cache import (
    DeviceCache,
    EnsureLaunch,
    EnsureTuning,
    device_policy_names,
    resolve_launch,
)
from expertcache.device.policies import (
    LT_BITS,
    MIRROR_MAX_LAYERS,
    POLICY_RULE,
    _rule_constants,
    _rule_score,
)
from expertcache.policies.base import PolicyKind
from expertcache.policies.rule import (
    LC_MAX,
    LOG2_1P_TABLE,
    ONE,
    TABLE_LEN,
    TABLE_SHIFT,
    Rule,
)
from expertcache.split import SPLIT_LEN
from tests.conftest import device_or_skip

KEYED = MIRROR_MAX_LAYERS + 1  # layers past what rule's mirror packs: rule scores through key_of
WIDE = {"w": 67.0}  # rule's constants past Rule.int32_scores: its score in int64


@triton.jit
def score_kernel(lk_ptr, lt_ptr, lcd_ptr, out_ptr, prm_ptr, layer, tok, dc_now, num_layers, N: tl.constexpr,
                 NARROW: tl.constexpr):
    i = tl.arange(0, N)
    rc = _rule_constants(prm_ptr, POLICY_RULE)
    s = _rule_score(tl.load(lk_ptr + i), tl.load(lt_ptr + i), tl.load(lcd_ptr + i), layer, tl.load(tok),
                    tl.load(dc_now), num_layers, rc, NARROW)
    tl.store(out_ptr + i, s)


def random_calls(rng, C, L, E, rows, k, T=0):
    """C calls in decode order over layers 0..L-1: ids int32 [C, rows, k] (distinct per row, some
    padding) and, with T > 0, top-T logits [C, rows, T] whose first k entries are the ids."""
    ids = np.argsort(rng.random((C, rows, E)), axis=-1)[..., :k].astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1
    layers = np.arange(C) % L
    if not T:
        return ids, layers, None, None
    extra = np.argsort(rng.random((C, rows, E)), axis=-1)[..., : T - k].astype(np.int32)
    lidx = np.concatenate([ids, extra], axis=-1)
    lval = np.sort(rng.standard_normal((C, rows, T)).astype(np.float32), axis=-1)[..., ::-1]
    lval = np.round(lval * 8) / 8  # coarse values: ties and exact near-miss margins happen
    return ids, layers, lidx.astype(np.int32), np.ascontiguousarray(lval, dtype=np.float32)


def snapshot_differences(dev, ref) -> list[str]:
    """Each array of two snapshots that differs: its name, how many entries, and the first few (index,
    device value, host value), so that a parity failure on the GPU says where the state went apart."""
    out = []
    pairs = [(n, getattr(dev, n), getattr(ref, n)) for n in ("slot_of", "key_of", "clock", "counters", "served")]
    pairs += [(f"policy.{n}", getattr(dev.policy, n), getattr(ref.policy, n)) for n in ("key", "slot", "glob")]
    for name, x, y in pairs:
        if x.shape != y.shape:
            out.append(f"{name}: shape {x.shape} vs {y.shape}")
        elif not np.array_equal(x, y):
            at = np.argwhere(x != y)
            out.append(f"{name}: {len(at)} differ, first " + ", ".join(
                f"{tuple(int(i) for i in ix)} {x[tuple(ix)]} vs {y[tuple(ix)]}" for ix in at[:4]))
    return out


def run_parity(policy, L, E, S, rows, k, C, T=0, seed=0, tuning=None, call_layers=None, split=None,
               snapshot_every=1, **constants):
    """C random calls through HostCache and DeviceCache (tuning: its tiles; constants: the policy's; split:
    the miss split of both), their plans, slots, copy counts, filled prefix and rule's mirror compared
    after every call and the whole state after every `snapshot_every`-th call and the last; the calls
    visit layers 0..call_layers-1 of the L (all by default)."""
    device, _ = device_or_skip()
    g = CacheGeometry(L, E, S)
    ref = HostCache(g, policy, split=split, **constants)
    dev = DeviceCache(g, policy, device=device, tuning=tuning, split=split, **constants)
    rng = np.random.default_rng(seed)
    ids, layers, lidx, lval = random_calls(rng, C, call_layers or L, E, rows, k, T)
    for c in range(C):
        li = None if lidx is None else lidx[c]
        lv = None if lval is None else lval[c]
        res = ref.ensure(int(layers[c]), ids[c], li, lv)
        def t(a):
            return None if a is None else torch.as_tensor(a, device=device)
        buf = dev.ensure(int(layers[c]), t(ids[c]), t(li), t(lv))
        m = int(buf.count.item())
        assert m == res.copies, (policy, c)
        assert np.array_equal(buf.plan[:m].cpu().numpy(), res.plan), (policy, c)
        assert np.array_equal(buf.slots.cpu().numpy(), res.slots), (policy, c)
        if dev.launch.mirror:  # each filled slot's mirror is its key's lt | layer << 56 and lc + dct
            full = np.flatnonzero(ref.key_of >= 0)
            kf = ref.key_of[full]
            want = np.stack([ref.state.key[0, kf] | (kf.astype(np.int64) // E) << LT_BITS.value,
                             ref.state.key[1, kf] + ref.state.key[2, kf]])
            assert np.array_equal(dev.mirror.cpu().numpy()[:, full], want), (policy, c)
        # the filled-prefix word: the copied misses
        assert int(dev.missed.item()) == int(ref.counters[:, 2].sum() - ref.served.sum()), (policy, c)
        if (c + 1) % snapshot_every == 0 or c == C - 1:
            a, b = dev.snapshot(), ref.snapshot()
            assert a.equals(b), (policy, c, snapshot_differences(a, b))
    dev.check()
    return ref


@pytest.mark.parametrize("policy", device_policy_names())
@pytest.mark.parametrize("E, S, rows, k, T", [(8, 5, 1, 2, 0), (8, 12, 2, 3, 5), (16, 40, 1, 4, 6)])
def test_device_matches_host_small(policy, E, S, rows, k, T):
    """Several programs (chunk 8) score and merge, as on a large pool."""
    ref = run_parity(policy, L=3, E=E, S=S, rows=rows, k=k, C=30, T=T, seed=S, tuning=EnsureTuning(chunk=8))
    assert ref.counters[:, 2].sum() > S, "the case must evict"


HALF = MissSplit("hybrid", (np.arange(SPLIT_LEN) // 2).astype(np.int32))


@pytest.mark.parametrize("policy", device_policy_names())
@pytest.mark.parametrize("split", [HALF, MissSplit.cpu(), MissSplit.hybrid(ChannelCosts(5.0, 100.0, 15.0, 140.0))],
                         ids=["half", "cpu", "hybrid"])
@pytest.mark.parametrize("E, S, rows, k, T, chunk", [(8, 6, 2, 3, 5, 8), (16, 24, 2, 4, 6, 64)])
def test_device_split_matches_host(policy, split, E, S, rows, k, T, chunk):
    """The miss split on the device: which misses are copied (the policy's priority, rule's after its
    near-miss refresh, the (key, step) draw of lru and lfuda), the served misses' CPU_SLOT, the served
    counters, and every other array, bit for bit with the host after every call."""
    ref = run_parity(policy, L=3, E=E, S=S, rows=rows, k=k, C=30, T=T, seed=S + k, tuning=EnsureTuning(chunk=chunk),
                     split=split)
    assert ref.served.sum() > 0
    if split.service != "cpu":
        assert ref.counters[:, 2].sum() > ref.served.sum() + S, "the case must copy and evict"


@pytest.mark.parametrize("policy", device_policy_names())
@pytest.mark.parametrize("chunk", [16, 64])
def test_device_matches_host_many_victims(policy, chunk):
    """Calls needing more victims than successive minima take (a sort per program and in
    the merge), on two programs (chunk 16) and on one (chunk 64)."""
    ref = run_parity(policy, L=2, E=32, S=20, rows=2, k=8, C=12, T=12, seed=chunk, tuning=EnsureTuning(chunk=chunk))
    assert ref.counters[:, 2].sum() > 60


@pytest.mark.parametrize("policy", device_policy_names())
@pytest.mark.parametrize("chunk, seq_max", [(8, 0), (8, 16), (64, 0), (64, 16)])
def test_victims_by_minima_or_by_sort_agree(policy, chunk, seq_max):
    """Every call's victims by successive minima (seq_max 16: kept in registers up to the
    commit) or by a sort (seq_max 0: through scratch), on several programs and on one."""
    ref = run_parity(policy, L=2, E=24, S=16, rows=2, k=5, C=14, T=7, seed=seq_max + chunk,
                     tuning=EnsureTuning(chunk=chunk, seq_max=seq_max))
    assert ref.counters[:, 2].sum() > 32


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("T", [0, 6], ids=["", "logits"])
@pytest.mark.parametrize("S", [24, 30], ids=["evicting", "mostly-hits"])
@pytest.mark.parametrize("layers", [2, KEYED], ids=["mirror", "through-keys"])
def test_rule_mirror_and_through_keys(chunk, T, S, layers):
    """rule scores from its per-slot mirror (lt, lc + dct, layer, and the hits pinned), or, past the
    layers the mirror packs, through each slot's key (key_of, the per-key rows, the pinned test per
    query position); the host's state bit for bit and, with the mirror, the mirror equal to the
    resident keys' rows after every call, with and without router logits (near-miss refresh of
    resident and absent keys), on several programs and one, while the pool fills, when nearly every
    call evicts (24 slots for 32 keys) and when most calls do not (30 slots: the commit alone
    refreshes the mirror). The calls visit two layers either way."""
    ref = run_parity("rule", L=layers, E=16, S=S, rows=2, k=4, C=40, T=T, seed=chunk + T + S,
                     tuning=EnsureTuning(chunk=chunk), call_layers=2)
    assert ref.counters[:, 2].sum() > 32


@pytest.mark.parametrize("policy", device_policy_names())
@pytest.mark.parametrize("chunk", [8, 64])
def test_kernel_matches_host_with_a_filling_pool(policy, chunk):
    """Calls with misses while the pool still has empty slots (victims and empty slots in one
    call), duplicates and padding, hits among the oldest stamps, with router logits, on several
    programs and one."""
    ref = run_parity(policy, L=3, E=16, S=40, rows=2, k=4, C=40, T=6, seed=chunk + 5, tuning=EnsureTuning(chunk=chunk))
    assert ref.counters[:, 2].sum() > 40


def test_rule_lc_never_exceeds_its_bound():
    """Rule.int32_scores rests on LC_MAX: a use of a key whose decayed lc is x <= LC_MAX leaves at most
    LC_MAX (the table's last entry is 0, so from 30 * ONE on a use adds nothing), for every x."""
    assert LOG2_1P_TABLE[TABLE_LEN - 1] == 0 and LOG2_1P_TABLE.max() == ONE
    x = np.arange(-64 * ONE, LC_MAX + 1, dtype=np.int64)
    grown = np.maximum(x, 0) + LOG2_1P_TABLE[np.minimum(np.abs(x) >> TABLE_SHIFT, TABLE_LEN - 1)]
    assert grown.max() == LC_MAX
    assert np.array_equal(grown[x >= 30 * ONE], x[x >= 30 * ONE])  # no growth up there
    assert grown[x < 30 * ONE].max() <= LC_MAX  # below it, at most one ONE of growth


def test_rule_int32_scores_by_constants():
    """Where rule's constants keep every score term in int32 (the defaults at any layer count, w up to 66,
    k_max up to 2**15 - 1 with a small w), DeviceCache scores in int32; past that in int64; only rule
    scores in int32."""
    device, _ = device_or_skip()
    for L in (1, 3, 48, 127, 4096):
        assert Rule(CacheGeometry(L, 8, 4)).int32_scores()
    g = CacheGeometry(2, 16, 8)
    fits = {"w": 66.0}, {"k_max": 2**15 - 1, "w": 0.5, "beta": 0.1, "lc_floor": -1}
    over = WIDE, {"k_max": 2**15}, {"lc_floor": -2**20}, {"k_max": 2**15 - 1, "beta": 10.0**6}
    for constants in fits:
        assert Rule(g, **constants).int32_scores(), constants
        assert DeviceCache(g, "rule", device=device, **constants).launch.narrow
    for constants in over:
        assert not Rule(g, **constants).int32_scores(), constants
        assert not DeviceCache(g, "rule", device=device, **constants).launch.narrow
    assert not DeviceCache(g, "lru", device=device).launch.narrow
    with pytest.raises(ValueError, match="EnsureLaunch.narrow is for the rule policy"):
        EnsureLaunch(PolicyKind.LFUDA, False, True, EnsureTuning())


@pytest.mark.parametrize("constants", [{}, {"w": 66.0}, {"k_max": 2**15 - 1, "w": 0.5, "beta": 0.1, "lc_floor": -1}],
                         ids=["defaults", "w-at-its-limit", "k_max-at-its-limit"])
def test_rule_score_int32_equals_int64(constants):
    """_rule_score in int32 (NARROW) gives the int64 score's values, and the host's, over the whole range a
    resident key can be in: tok and its last use anywhere below 2**56 (k clamped at 0 and at K_MAX), every
    layer before, at and after the call's, and lc + dct - DC(now) from far below the floor up to LC_MAX."""
    device, _ = device_or_skip()
    L, N = 48, 4096
    pol = Rule(CacheGeometry(L, 8, 4), **constants)
    assert pol.int32_scores()
    rng = np.random.default_rng(len(constants))
    prm = torch.as_tensor(pol.params(), device=device)
    for tok in (5, 2**20 + 3, 2**31 - 2, 2**31 - 1, 2**40 + 7, 2**56 - 9):  # 32-bit differences below 2**31 - 1
        layer = int(rng.integers(0, L))
        lk = rng.integers(0, L, N).astype(np.int64)
        back = np.concatenate([rng.integers(0, 3, N // 4), rng.integers(0, 2 * pol.k_max, N // 4),
                               rng.integers(0, tok + 1, N // 2)])
        lt = np.maximum(tok - rng.permutation(back), 0).astype(np.int64)
        dc_now = int(rng.integers(2**30, 2**50))
        lcv = np.concatenate([rng.integers(-2**45, pol.lc_floor, N // 4),
                              rng.integers(pol.lc_floor, LC_MAX + 1, N // 2 - 2), [LC_MAX, pol.lc_floor],
                              rng.integers(LC_MAX - 64, LC_MAX + 1, N // 4)])
        lcd = (dc_now + rng.permutation(lcv)).astype(np.int64)
        later = lk > layer
        k = np.clip(np.where(later, tok - 1, tok) - lt, 0, pol.k_max)
        d = np.where(later, lk - layer, L - layer + lk)
        want = -((k << 16) + d * pol.beta_q) + ((pol.w_q * np.maximum(lcd - dc_now, pol.lc_floor)) >> 4)
        def t(a):
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)
        for narrow in (False, True):
            out = torch.empty(N, dtype=torch.int64, device=device)
            score_kernel[(1,)](t(lk), t(lt), t(lcd), out, prm, layer, t([tok]), t([dc_now]), L, N=N,
                               NARROW=narrow)
            assert np.array_equal(out.cpu().numpy(), want), (tok, narrow)
            assert want.min() >= -2**31 and want.max() < 2**31


@pytest.mark.parametrize("layers", [3, KEYED], ids=["mirror", "through-keys"])
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("constants", [{}, WIDE], ids=["int32", "int64"])
def test_rule_score_widths_match_host(layers, chunk, constants):
    """rule's score in int32 (its default constants) or in int64 (constants past Rule.int32_scores) gives
    the host reference's plans, slots and state bit for bit, with router logits, on several programs
    and one, from its mirror and through the keys."""
    ref = run_parity("rule", L=layers, E=16, S=24, rows=2, k=4, C=40, T=6, seed=chunk + 11,
                     tuning=EnsureTuning(chunk=chunk), call_layers=3, **constants)
    assert ref.counters[:, 2].sum() > 40


def test_launch_resolved_by_pool_policy_and_layers():
    """The default tiles at every pool size (lru, lfuda and rule with its mirror: one program up to
    2048 slots, lfuda's and rule's of 8 warps; rule through the keys: 512-slot programs); rule's mirror
    up to the layers its packed word holds; given tiles kept; bad tiles and launches refused, naming
    the field."""
    device, _ = device_or_skip()
    for policy, L, S, chunk, warps, grid in (
            ("lru", 1, 8, 512, 4, 1), ("lru", 1, 512, 512, 4, 1), ("lru", 1, 1650, 2048, 4, 1),
            ("lru", 1, 2048, 2048, 4, 1), ("lru", 1, 2049, 512, 4, 5), ("lru", 1, 16384, 512, 4, 32),
            ("lfuda", 1, 512, 512, 4, 1), ("lfuda", 1, 1650, 2048, 8, 1), ("lfuda", 1, 4096, 512, 4, 8),
            ("rule", 1, 1650, 2048, 8, 1), ("rule", 1, 8, 512, 4, 1), ("rule", 1, 4096, 512, 4, 8),
            ("rule", KEYED, 1650, 512, 4, 4)):
        dev = DeviceCache(CacheGeometry(L, 4 * S, S), policy, device=device)
        tiles = dev.launch.tuning
        assert (tiles.chunk, tiles.num_warps, dev.grid) == (chunk, warps, grid), (policy, S)
        assert dev.launch.mirror == (policy == "rule" and L == 1), (policy, L)
    assert DeviceCache(CacheGeometry(MIRROR_MAX_LAYERS, 4, 8), "rule", device=device).launch.mirror
    assert not DeviceCache(CacheGeometry(KEYED, 4, 8), "rule", device=device).launch.mirror
    g = CacheGeometry(1, 64, 1650)
    given = EnsureTuning(chunk=1024, num_warps=2, seq_max=4)
    assert DeviceCache(g, "lfuda", device=device, tuning=given).launch.tuning == given
    assert resolve_launch(g, Rule(g)).tuning == EnsureTuning(2048, 8)
    for bad in ({"chunk": 3}, {"chunk": True}, {"num_warps": 3}, {"num_warps": True}, {"seq_max": -1}):
        with pytest.raises(ValueError, match=f"EnsureTuning.{next(iter(bad))}"):
            EnsureTuning(**bad)
    with pytest.raises(ValueError, match="tuning must be an EnsureTuning"):
        DeviceCache(g, "lru", device=device, tuning=(512, 4))
    with pytest.raises(ValueError, match="EnsureLaunch.mirror is for the rule policy"):
        EnsureLaunch(PolicyKind.LRU, True, False, EnsureTuning())
    with pytest.raises(ValueError, match="EnsureLaunch.policy"):
        EnsureLaunch(7, False, False, EnsureTuning())
    assert replace(EnsureTuning(), seq_max=4).chunk == 512


@pytest.mark.parametrize("policy", device_policy_names())
def test_calls_without_misses_commit_at_once_on_many_programs(policy):
    """A call without misses is committed by program 0 with no arrival; the interpreter runs the
    other programs after that commit, so they read the committed state (the late-reader case)."""
    device, _ = device_or_skip()
    g = CacheGeometry(2, 16, 40)
    ref, dev = HostCache(g, policy), DeviceCache(g, policy, device=device, tuning=EnsureTuning(chunk=8))  # 5 programs
    calls = [(0, [[1, 2, 3]]), (0, [[3, 2, 1]]), (1, [[4, 5]]), (0, [[2, -1, 1]]), (1, [[5, 4]]),
             (0, [[9, 1]]), (0, [[1, 9]])]
    quick = 0
    for layer, ids in calls:
        a = np.array(ids, dtype=np.int32)
        res = ref.ensure(layer, a)
        buf = dev.ensure(layer, torch.as_tensor(a, device=device))
        quick += res.misses == 0
        assert int(buf.count.item()) == res.misses
        assert np.array_equal(buf.slots.cpu().numpy(), res.slots)
        assert dev.snapshot().equals(ref.snapshot())
        assert int(dev.arrive.item()) == 0  # nobody left an arrival behind
    assert quick == 4
    dev.check()


def test_stats_follow_the_counters():
    device, _ = device_or_skip()
    g = CacheGeometry(2, 8, 4)
    dev = DeviceCache(g, "lru", device=device)
    for layer, ids in ((0, [1, 2]), (1, [1, 2]), (0, [1, 3]), (1, [2, 5])):
        dev.ensure(layer, torch.tensor([ids], dtype=torch.int32, device=device))
    st = dev.stats(bytes_per_expert=100)
    assert st["calls"].tolist() == [2, 2] and st["accesses"].tolist() == [4, 4]
    assert st["misses"].tolist() == [3, 3] and st["total_misses"] == 6  # 2 cold + 1 each
    assert st["hit_rate"] == pytest.approx(1 - 6 / 8) and st["bytes_copied"] == 600
    assert st["misses_per_layer_per_token"].tolist() == [1.5, 1.5]


@pytest.mark.parametrize("policy", device_policy_names())
def test_refused_calls_change_nothing_and_are_reported(policy):
    device, _ = device_or_skip()
    g = CacheGeometry(2, 8, 3)
    dev = DeviceCache(g, policy, device=device)
    dev.ensure(0, torch.tensor([[1, 2]], dtype=torch.int32, device=device))
    before = dev.snapshot()
    dev.ensure(1, torch.tensor([[9, 1]], dtype=torch.int32, device=device))
    assert dev.snapshot().equals(before)
    with pytest.raises(EnsureError, match="num_experts"):
        dev.check()
    dev.ensure(1, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device))
    assert dev.snapshot().equals(before)
    with pytest.raises(EnsureError, match="--moe-slots"):
        dev.check()
    with pytest.raises(EnsureError, match="int32"):
        dev.ensure(0, torch.tensor([[1]], dtype=torch.int64, device=device))
    with pytest.raises(EnsureError, match="layer"):
        dev.ensure(2, torch.tensor([[1]], dtype=torch.int32, device=device))
    with pytest.raises(EnsureError, match="rows \\* top_k"):
        dev.ensure(0, torch.full((2, 512), -1, dtype=torch.int32, device=device))
    assert dev.snapshot().equals(before)
    with pytest.raises(EnsureError, match="no device ensure.*lfuda, lru, markov, rule"):
        from sim.belady import Belady
        DeviceCache(g, Belady(g, np.zeros(1, np.int64)), device=device)


PDL_CHECK = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from expertcache.copy import _JIT_OPTIONS as COPY_JIT, _miss_copy_kernel
from expertcache.device.ensure import JIT_OPTIONS, KERNEL_TYPES, ensure_kernel
from moe.kernels.triton_launch import compile_for_sm

out = []
for gdc in (False, True):
    cx = dict(POLICY=0, HAS_LOGITS=False, CHUNK=512, BLOCK_Q=16, BLOCK_R=1, BLOCK_C=512,
              SINGLE=False, SEQ_MAX=4, MIRROR=False, NARROW=False, GDC=gdc)
    out.append("griddepcontrol.wait" in compile_for_sm(ensure_kernel, KERNEL_TYPES, cx, 4, 90, JIT_OPTIONS)["ptx"])
    fn = JITFunction(_miss_copy_kernel.fn, **COPY_JIT)
    sig = {"count_ptr": "*i32", "plan_ptr": "*i32", "num_rows": "i32", "num_keys": "i32", "num_slots": "i32",
           "src_ptrs": ("*i32", "*i32"), "dst_ptrs": ("*i32", "*i32")}
    ccx = dict(NUM_BANKS=2, ROW_WORDS=(1024, 512), FIRST_CHUNK=(0, 1, 2), CHUNKS_PER_ROW=2, BLOCK=1024, GDC=gdc)
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in ccx}}, constexprs=ccx)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out.append("griddepcontrol.wait" in ptx)
    out.append("griddepcontrol.launch_dependents" in ptx)
print(json.dumps(out))
"""


def test_programmatic_launch_variants_compile_for_sm90():
    """DeviceCache.ensure(pdl=True) and miss_copy(pdl=True) (MoEConfig.pdl_chain) compile for sm_90 and
    wait for their predecessor; the default launches do not. The copy never lets the next kernel launch
    early (its programs would sit on the SMs for the whole copy). A child process without TRITON_INTERPRET."""
    from tests.conftest import compile_check
    assert compile_check(PDL_CHECK) == [False, False, False, True, True, False]


MIRROR_CHECK = r"""
import json
from expertcache.device.ensure import JIT_OPTIONS, KERNEL_TYPES, ensure_kernel
from moe.kernels.triton_launch import compile_for_sm

out = []
for chunk, single, warps in ((2048, True, 8), (512, False, 4)):
    for logits in (False, True):
        cx = dict(POLICY=1, HAS_LOGITS=logits, CHUNK=chunk, BLOCK_Q=16, BLOCK_R=32 if logits else 1,
                  BLOCK_C=16 if single else 64, SINGLE=single, SEQ_MAX=16, MIRROR=True, NARROW=True)
        asm = compile_for_sm(ensure_kernel, KERNEL_TYPES, cx, warps, 90, JIT_OPTIONS)
        out.append(bool(asm.get("cubin")) and ".local" not in asm["ptx"])
        # the query's loads (ids, then slot_of: 32-bit) are issued before the decay clock's division
        lines = asm["ptx"].splitlines()
        div = next(i for i, line in enumerate(lines) if "div.s64" in line)
        out.append(sum("ld.global.b32" in line for line in lines[:div]) >= 2)
print(json.dumps(out))
"""


def test_rule_mirror_compiles_for_sm90():
    """rule with its mirror compiles for sm_90 on one program of 2048 and on 512-slot programs, with
    and without router logits, without register spills, and issues the query's loads before its
    decay clock's 64-bit division (a subroutine call on sm_90 that no later load passes). A child
    process without TRITON_INTERPRET."""
    from tests.conftest import compile_check
    assert compile_check(MIRROR_CHECK) == [True] * 8


MARKOV_CHECK = r"""
import json
from expertcache.device.ensure import JIT_OPTIONS, KERNEL_TYPES, ensure_kernel
from moe.kernels.triton_launch import compile_for_sm

cx = dict(POLICY=3, HAS_LOGITS=False, CHUNK=512, BLOCK_Q=16, BLOCK_R=1, BLOCK_C=64, SINGLE=False, SEQ_MAX=16,
          MIRROR=False, NARROW=False)
asm = compile_for_sm(ensure_kernel, KERNEL_TYPES, cx, 4, 90, JIT_OPTIONS)
print(json.dumps(bool(asm.get("cubin"))))
"""


def test_markov_ensure_compiles_for_sm90():
    """The ensure kernel's markov variant (scores from V through key_of, no touch) compiles for sm_90
    (its learning step's launch: tests/expertcache/test_device_markov.py). A child process without
    TRITON_INTERPRET."""
    from tests.conftest import compile_check
    assert compile_check(MARKOV_CHECK) is True
