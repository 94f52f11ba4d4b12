"""expertcache.device.markov.markov_observe against the host's Markov.observe, bit for bit: the whole
state (every table row, row total, frequency, history, prediction and the layers' totals) after each of
many calls over random routing, with caps small enough that rows and layers are halved often, one and
two lags, duplicate and padded ids; bad arguments named. CPU: Triton's interpreter; the same on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertcache import CacheGeometry, get_policy
from expertcache.device.markov import markov_observe
from expertcache.policies.base import Clock
from tests.conftest import device_or_skip


@pytest.mark.parametrize("lags, row_cap, freq_cap", [(2, 3, 5), (1, 2, 4), (2, 100, 300)])
def test_observe_is_the_hosts_bit_for_bit(lags, row_cap, freq_cap):
    device, _ = device_or_skip()
    L, E, k = 3, 24, 4
    geometry = CacheGeometry(L, E, 20)
    pol = get_policy("markov", geometry, lags=lags, row_cap=row_cap, freq_cap=freq_cap)
    st = pol.init_state()
    rng = np.random.default_rng(lags * 100 + row_cap)
    hot = rng.choice(E, size=8, replace=False)  # a skewed routing: rows fill and pass their caps
    kst, gst = torch.from_numpy(st.key.copy()).to(device), torch.from_numpy(st.glob.copy()).to(device)
    params = pol.params()
    for c in range(60):
        layer = c % L
        ids = np.where(rng.random(2 * k) < 0.7, rng.choice(hot, 2 * k), rng.integers(0, E, 2 * k))
        ids[rng.random(2 * k) < 0.15] = -1  # padding
        slot_of = np.where(rng.random(L * E) < 0.3, rng.integers(0, 20, L * E), -1).astype(np.int32)
        keys = np.unique(ids[ids >= 0]).astype(np.int64) + layer * E
        if keys.size == 0:
            continue
        pol.observe(st, Clock(c + 1, c // L + 1, layer, L, E), keys, slot_of)
        markov_observe(kst, gst, params, layer, torch.from_numpy(ids.astype(np.int32)).to(device),
                       torch.from_numpy(slot_of).to(device), E)
        got = kst.cpu().numpy()
        bad = np.argwhere(got != st.key)
        assert bad.size == 0, (c, bad[:5], pol.key_fields[bad[0][0]] if bad.size else None)
        assert np.array_equal(gst.cpu().numpy(), st.glob), c


def test_bad_arguments_are_named():
    device, _ = device_or_skip()
    pol = get_policy("markov", CacheGeometry(2, 8, 4))
    st = pol.init_state()
    kst, gst = torch.from_numpy(st.key.copy()).to(device), torch.from_numpy(st.glob.copy()).to(device)
    ids = torch.tensor([1, 2], dtype=torch.int32, device=device)
    slot_of = torch.full((16,), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="layer 2 is outside"):
        markov_observe(kst, gst, pol.params(), 2, ids, slot_of, 8)
    with pytest.raises(ValueError, match="slot_of must be"):
        markov_observe(kst, gst, pol.params(), 0, ids, slot_of.long(), 8)
    with pytest.raises(ValueError, match="fields"):
        markov_observe(kst[:-1].contiguous(), gst, pol.params(), 0, ids, slot_of, 8)
    with pytest.raises(ValueError, match="kst must be"):
        markov_observe(kst.long(), gst, pol.params(), 0, ids, slot_of, 8)


SM90 = """
import json
from expertcache.device.markov import ROW_WARPS, _markov_predict_kernel, _markov_rows_kernel
from moe.kernels.triton_launch import _cuobjdump, compile_for_sm
rows = [compile_for_sm(_markov_rows_kernel, ("*i32", "*i64", "*i32", "*i64") + ("i32",) * 7,
                       {"E": e, "BLOCK": e, "IDS": ids}, ROW_WARPS, 90, {})
        for e, ids in ((512, 16), (512, 64), (128, 64))]
predict = compile_for_sm(_markov_predict_kernel, ("*i32", "*i64", "*i32", "*i64", "*i32") + ("i32",) * 7,
                         {"E": 512, "BLOCK": 512, "IDS": 16, "CHUNK": 64, "RB": 16, "MAXJ": 2}, 4, 90, {})
print(json.dumps([all(r.get("cubin") for r in rows), bool(predict.get("cubin")),
                  [".reqntid 32\\n" in r["ptx"] for r in rows],
                  ["STACK:0 " in _cuobjdump(r["cubin"], "-res-usage") for r in rows]]))
"""


def test_compiles_for_sm90_at_qwen3_next_experts():
    """Both kernels compile for sm_90; the rows kernel, at 512 experts and 16 or 64 ids and at 128 and 64, as
    one warp of 32 threads a program: its reductions stay within a warp (ROW_WARPS: see
    expertcache.device.markov), and its registers hold the call's membership (no stack: nothing spilled)."""
    from tests.conftest import compile_check

    assert compile_check(SM90) == [True, True, [True] * 3, [True] * 3]


@pytest.mark.parametrize("kernel, options", [("_markov_rows_kernel", "ROWS_JIT"),
                                             ("_markov_predict_kernel", "PREDICT_JIT")])
def test_no_scalar_argument_is_specialised(kernel, options):
    """Triton turns an int argument equal to 1 into a constant unless told not to (and compiles a kernel per
    such value): every scalar of the learning step's kernels is listed, so prior = 1 or layer = 1 compiles."""
    import inspect

    from expertcache.device import markov as device_markov

    k = getattr(device_markov, kernel)
    fn = getattr(k, "fn", k)
    scalars = [name for name, p in inspect.signature(fn).parameters.items()
               if not name.endswith("_ptr") and "constexpr" not in str(p.annotation)]
    assert scalars and set(scalars) == set(getattr(device_markov, options)["do_not_specialize"])
