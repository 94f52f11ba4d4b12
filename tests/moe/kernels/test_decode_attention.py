"""moe.kernels.decode_attention against its float32 reference: rows of different lengths in one call,
GQA, any split count (one key per split up to all keys in one), bitwise repeatable; gpt-oss's sinks and a
sliding layer's ring; bad arguments named. CPU: Triton's interpreter; the same tests on a GPU."""

from __future__ import annotations

import pytest
import torch

from moe.kernels.decode_attention import BLOCK_N, decode_attention, decode_attention_reference, splits_for
from tests.conftest import device_or_skip

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _case(device, b, hq, hkv, d, max_len, lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype)  # one spare row: never read
    v = torch.randn(b + 1, hkv, max_len, d, generator=g).to(dtype)
    return q.to(device), k.to(device), v.to(device), torch.tensor(lengths, dtype=torch.int64).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [None, 1, 3, 7])
def test_matches_the_reference_for_rows_of_different_lengths(dtype, splits):
    device, _ = device_or_skip()
    # row lengths: a single key, inside the first block, across blocks, the whole cache
    max_len = 2 * BLOCK_N + 9
    q, k, v, lengths = _case(device, 4, 8, 2, 32, max_len, [0, 5, BLOCK_N + 3, max_len - 1], dtype, seed=1)
    got = decode_attention(q, k, v, lengths, 32 ** -0.5, splits=splits)
    want = decode_attention_reference(q, k, v, lengths, 32 ** -0.5)
    assert got.dtype == dtype and got.shape == (4, 8, 32)
    err = (got.float() - want).abs().max().item()
    assert err <= TOL[dtype] * want.abs().max().item(), err
    assert torch.equal(got, decode_attention(q, k, v, lengths, 32 ** -0.5, splits=splits))


def test_keys_past_a_rows_length_are_never_read():
    device, _ = device_or_skip()
    q, k, v, lengths = _case(device, 2, 4, 4, 16, 40, [9, 30], torch.float32, seed=2)
    got = decode_attention(q, k, v, lengths, 0.25, splits=4)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 10:] = float("nan")
    v2[1, :, 31:] = float("inf")
    assert torch.equal(decode_attention(q, k2, v2, lengths, 0.25, splits=4), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_and_a_ring_match_the_reference(dtype, splits):
    """gpt-oss: each head's sink logit (random, some above every score, so it takes most of a head's
    probability) and a ring of 12 positions: rows that have not filled it (0 and 6 keys), one that has
    just filled it (11) and two long past it (40, 1000: all 12 entries seen, nothing past them read)."""
    device, _ = device_or_skip()
    q, k, v, lengths = _case(device, 5, 8, 2, 32, 12, [0, 6, 11, 40, 1000], dtype, seed=4)
    sinks = (torch.randn(8, generator=torch.Generator().manual_seed(5)) * 3).to(dtype).to(device)
    for ring in (False, True):
        lens = lengths if ring else lengths.clamp(max=11)
        got = decode_attention(q, k, v, lens, 32 ** -0.5, splits=splits, sinks=sinks, ring=ring)
        want = decode_attention_reference(q, k, v, lens, 32 ** -0.5, sinks=sinks, ring=ring)
        err = (got.float() - want).abs().max().item()
        assert err <= TOL[dtype] * want.abs().max().item(), (ring, err)
    plain = decode_attention_reference(q, k, v, lengths, 32 ** -0.5, ring=True)
    assert (plain - want).abs().max().item() > 0.1 * plain.abs().max().item()  # the sinks take their share
    assert torch.equal(decode_attention(q, k, v, lengths, 32 ** -0.5, splits=splits, ring=True),
                       decode_attention(q, k, v, lengths.clamp(max=11), 32 ** -0.5, splits=splits))


def test_the_split_count_fills_the_gpu_and_stays_within_the_keys():
    assert splits_for(1, 4, 32768) == 66
    assert splits_for(4, 4, 32768) == 16
    assert splits_for(1, 4, 100) == 2  # no more splits than blocks of max_len
    assert splits_for(64, 8, 4096) == 1


@pytest.mark.parametrize("bad, message", [
    ("q", "q must be [B, Hq, D]"), ("dim", "does not fit q"), ("heads", "does not fit q"),
    ("dtype", "k_cache must be contiguous, of q's dtype"), ("lengths", "lengths must be int64"),
    ("splits", "splits=0"), ("sinks", "sinks must be a contiguous float [4] tensor"),
])
def test_bad_arguments_are_named(bad, message):
    device, _ = device_or_skip()
    q, k, v, lengths = _case(device, 2, 4, 2, 16, 8, [1, 2], torch.float32, seed=3)
    kw = {"splits": 0} if bad == "splits" else {"sinks": torch.zeros(2, device=device)} if bad == "sinks" else {}
    if bad == "q":
        q = q[0]
    if bad == "dim":
        q = q[..., :8]
    if bad == "heads":
        q = torch.cat([q, q[:, :1]], dim=1)
    if bad == "dtype":
        k = k.double()
    if bad == "lengths":
        lengths = lengths.int()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_attention(q, k, v, lengths, 0.5, **kw)


SM90 = """
import json
from moe.kernels.decode_attention import compile_for_target, splits_for
out = {}
for dtype in ("bf16", "fp32"):
    asm = compile_for_target(32, 4, 128, splits_for(1, 4, 32768), dtype)
    out[dtype] = sorted(name for name, a in asm.items() if a.get("cubin"))
asm = compile_for_target(64, 8, 64, splits_for(1, 8, 128), "bf16", sinks=True, ring=True)  # gpt-oss's sliding layer
out["gpt-oss"] = sorted(name for name, a in asm.items() if a.get("cubin"))
print(json.dumps(out))
"""


def test_compiles_for_sm90_at_qwen3_30b_a3b_heads():
    """32 query / 4 kv heads of 128, the 66 splits of a 32K cache at batch 1, and gpt-oss's sliding layer
    (64 / 8 heads of 64, sinks, a ring of 128) (a child process without the interpreter)."""
    from tests.conftest import compile_check

    names = ["_combine_kernel", "_split_kernel"]
    assert compile_check(SM90) == {"bf16": names, "fp32": names, "gpt-oss": names}
