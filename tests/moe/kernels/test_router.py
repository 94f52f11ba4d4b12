"""router_topk (one Triton launch) against router_reference and moe.model.reference.route.

Legend: T = tokens, H = hidden, E = experts, k = top_k. CPU runs use Triton's interpreter
(tests/conftest.py), so their shapes are tiny; the `gpu` tests use the Qwen3-Next shape (H 2048,
E 512, k 10). The kernel's float32 sums run in another order than torch's, so where two
probabilities nearly tie the order may differ: ids are compared exactly on the rows whose first
k + 1 sorted probabilities are separated by a clear margin (most rows must be), weights everywhere.
"""

import pytest
import torch

from moe.kernels.plan import GEMV_MAX_TOKENS
from moe.kernels.router import router_reference, router_scratch, router_topk
from moe.kernels.tiles import RouterTiles
from moe.model.reference import route
from tests.conftest import compile_check, device_or_skip

MARGIN = 1e-4  # relative gap between neighbouring sorted probabilities that summation order cannot close


def make_inputs(tokens: int, experts: int, hidden: int, dtype, device, seed: int):
    """hidden [T, H], router_w [E, H] with unit-variance logits, both in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    w = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    return x, w


def decisive(x: torch.Tensor, w: torch.Tensor, top_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T] bool: the first k + 1 sorted probabilities pairwise apart by more than MARGIN (relative)."""
    logits = x.float() @ w.float().T
    probs = torch.softmax(logits if bias is None else logits + bias.float(), dim=-1)
    top = torch.sort(probs, dim=-1, descending=True).values[:, :top_k + 1]
    gaps = top[:, :-1] - top[:, 1:]
    return (gaps > MARGIN * top[:, :-1]).all(dim=-1)


def check_against(got: tuple, want: tuple, keep: torch.Tensor) -> None:
    """ids equal on the `keep` rows, weights within float32 rounding everywhere (as sorted values)."""
    (gw, gi), (ww, wi) = got, want
    assert gw.dtype == torch.float32 and gi.dtype == torch.int32 and gi.shape == wi.shape
    assert torch.equal(gi[keep].cpu(), wi[keep].cpu())
    assert torch.allclose(gw.cpu(), ww.cpu(), rtol=1e-5, atol=1e-6)
    assert bool((gw[:, :-1] >= gw[:, 1:]).all()), "weights must descend"
    assert int(keep.sum()) >= 0.9 * keep.numel(), f"only {int(keep.sum())} of {keep.numel()} rows decisive"


@pytest.mark.parametrize("tokens", [1, 3])
def test_pre_is_the_slot_map_at_the_chosen_ids(tokens):
    """pre=(slot_of, layer * E, out): out[t, j] = slot_of[layer * E + ids[t, j]] (-1 where absent);
    ids and weights are those of a call without pre, bit for bit (the slots ride in the keys' low
    bits)."""
    device, _ = device_or_skip()
    experts, top_k, layers, layer = 16, 4, 3, 2
    x, w = make_inputs(tokens, experts, 64, torch.bfloat16, device, seed=41)
    g = torch.Generator().manual_seed(42)
    slot_of = torch.randint(-1, 40, (layers * experts,), generator=g, dtype=torch.int32).to(device)
    out = torch.full((tokens, top_k), -7, dtype=torch.int32, device=device)
    slot_of[layer * experts + 3] = (1 << 20) - 2  # the largest slot the packed keys carry
    weights, ids = router_topk(x, w, top_k, True, pre=(slot_of, layer * experts, out))
    assert torch.equal(out, slot_of[layer * experts + ids.long()])
    w0, i0 = router_topk(x, w, top_k, True)
    assert torch.equal(ids, i0) and torch.equal(weights, w0)
    bad = [("slot_of", (slot_of.long(), 0, out)), ("key_base", (slot_of, 40, out)),
           ("key_base", (slot_of, 5, out)), ("out", (slot_of, 0, out[:, :1].contiguous()))]
    for _what, pre in bad:
        with pytest.raises(ValueError, match="pre"):
            router_topk(x, w, top_k, True, pre=pre)


@pytest.mark.parametrize("dtype, tokens, experts, hidden, top_k, norm", [
    (torch.bfloat16, 1, 16, 64, 4, True), (torch.bfloat16, 8, 64, 64, 8, True),
    (torch.float16, 3, 20, 48, 3, False), (torch.float32, 5, 12, 32, 12, True),
    (torch.bfloat16, 2, 1, 16, 1, True), (torch.bfloat16, 2, 7, 16, 1, False),
])
def test_matches_reference(dtype, tokens, experts, hidden, top_k, norm):
    device, _ = device_or_skip()
    x, w = make_inputs(tokens, experts, hidden, dtype, device, seed=tokens * experts)
    got = router_topk(x, w, top_k, norm)
    check_against(got, router_reference(x, w, top_k, norm), decisive(x, w, top_k))
    ref_w, ref_i = route(x, w, top_k, norm)  # the layer's torch reference agrees too
    check_against(got, (ref_w, ref_i), decisive(x, w, top_k))
    sums = got[0].sum(dim=-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5) if norm else bool((sums < 1).all())
    assert not router_scratch(device, experts)[1].any(), "every arrival counter must be reset to 0"


@pytest.mark.parametrize("dtype, tokens, experts, hidden, top_k", [
    (torch.bfloat16, 1, 32, 64, 4), (torch.bfloat16, 6, 37, 80, 4), (torch.float32, 3, 12, 32, 2),
])
def test_router_bias_is_added_before_the_selection(dtype, tokens, experts, hidden, top_k):
    """gpt-oss's router: top-k of logits + router_b, softmax over the chosen; the bias (as large as the
    logits) changes which experts are chosen."""
    device, _ = device_or_skip()
    x, w = make_inputs(tokens, experts, hidden, dtype, device, seed=tokens + experts)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
    got = router_topk(x, w, top_k, True, router_b=bias)
    keep = decisive(x, w, top_k, bias)
    check_against(got, router_reference(x, w, top_k, True, bias), keep)
    check_against(got, route(x, w, top_k, True, bias), keep)
    assert not torch.equal(got[1], router_topk(x, w, top_k, True)[1])
    x8, w8 = make_inputs(2, experts, hidden, dtype, device, seed=9)
    bad = [bias[:-1].contiguous(), bias.double(), bias.to("meta")]
    for b in bad:
        with pytest.raises(ValueError, match="router_b must be"):
            router_topk(x8, w8, top_k, True, router_b=b)


@pytest.mark.parametrize("tokens, experts, top_k, n_group, topk_group, scaling, norm", [
    (3, 8, 2, 4, 2, 2.5, True), (5, 16, 4, 1, 1, 1.0, True), (2, 24, 3, 3, 1, 1.5, False),
    (4, 160, 8, 1, 1, 2.5, True), (2, 64, 6, 8, 3, 1.0, True),
])
def test_sigmoid_router_chooses_by_biased_scores_within_the_best_groups(tokens, experts, top_k, n_group, topk_group,
                                                                       scaling, norm):
    """GLM-4.5's router (scoring="sigmoid"): the ids of moe.model.reference.route exactly (in its order: the
    biased score descending), the weights within float32 rounding; a bias as large as the scores' spread
    and the group mask both change the choice."""
    device, _ = device_or_skip()
    x, w = make_inputs(tokens, experts, 32, torch.bfloat16, device, seed=experts + n_group)
    bias = 0.2 * torch.randn(experts, generator=torch.Generator().manual_seed(experts)).to(device)
    sel = dict(scoring="sigmoid", score_bias=bias, n_group=n_group, topk_group=topk_group, scaling=scaling)
    got = router_topk(x, w, top_k, norm, **sel)
    want = route(x, w, top_k, norm, **sel)
    assert torch.equal(got[1].cpu(), want[1].cpu())
    assert torch.allclose(got[0].cpu(), want[0].cpu(), rtol=1e-5, atol=1e-6)
    assert torch.equal(router_reference(x, w, top_k, norm, **sel)[1].cpu(), want[1].cpu())
    unbiased = router_topk(x, w, top_k, norm, **{**sel, "score_bias": None})[1]
    assert not torch.equal(unbiased, got[1])
    if n_group > 1:
        ungrouped = router_topk(x, w, top_k, norm, **{**sel, "n_group": 1, "topk_group": 1})[1]
        assert not torch.equal(ungrouped, got[1])


@pytest.mark.parametrize("kwargs, match", [
    ({"scoring": "relu"}, "scoring must be"), ({"score_bias": "softmax"}, "score_bias is the sigmoid router's"),
    ({"scoring": "sigmoid", "n_group": 3}, "n_group=3"), ({"scoring": "sigmoid", "n_group": 2, "topk_group": 3},
                                                          "topk_group <= n_group"),
    ({"n_group": 2}, "scoring='sigmoid'"), ({"scaling": 0.0}, "scaling must be"),
    ({"scoring": "sigmoid", "score_bias": "half"}, "score_bias must be"),
])
def test_bad_selections_are_named(kwargs, match):
    x, w = make_inputs(2, 8, 16, torch.bfloat16, "cpu", seed=0)
    if kwargs.get("score_bias") == "softmax":
        kwargs = {"score_bias": torch.zeros(8)}
    elif kwargs.get("score_bias") == "half":
        kwargs = {**kwargs, "score_bias": torch.zeros(8, dtype=torch.float16)}
    with pytest.raises(ValueError, match=match):
        router_topk(x, w, 2, True, **kwargs)


def test_uneven_tiles_and_outputs_reused():
    """E and H that no tile divides (every mask used); outputs given are the ones returned and rewritten."""
    device, _ = device_or_skip()
    x, w = make_inputs(4, 37, 80, torch.bfloat16, device, seed=3)
    tiles = RouterTiles(block_e_small=8, block_e=8, chunk_h=32, warps=2)
    weights = torch.full((4, 5), float("nan"), device=device)
    ids = torch.full((4, 5), -7, dtype=torch.int32, device=device)
    got = router_topk(x, w, 5, True, weights=weights, ids=ids, tiles=tiles)
    assert got[0] is weights and got[1] is ids
    check_against(got, router_reference(x, w, 5, True), decisive(x, w, 5))
    x2, _ = make_inputs(4, 37, 80, torch.bfloat16, device, seed=4)
    router_topk(x2, w, 5, True, weights=weights, ids=ids, tiles=tiles)  # same buffers, new tokens
    check_against((weights, ids), router_reference(x2, w, 5, True), decisive(x2, w, 5))


@pytest.mark.parametrize("tiles", [RouterTiles(), RouterTiles(block_e_small=8, block_e=8, chunk_h=32, warps=2)],
                         ids=["default", "uneven"])
def test_early_weights_change_no_bit(tiles):
    """early_weights (router_w's rows loaded before the programmatic wait, held in registers) gives
    the same bits as loading them in the sum, on even and uneven tiles (E, H that no tile divides:
    every mask)."""
    device, _ = device_or_skip()
    x, w = make_inputs(4, 37, 80, torch.bfloat16, device, seed=5)
    got = router_topk(x, w, 5, True, tiles=tiles, early_weights=True)
    want = router_topk(x, w, 5, True, tiles=tiles)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_early_weights_too_large_is_named():
    """early_weights holds block_e * H router_w elements per program: past
    EARLY_WEIGHTS_MAX_ELEMENTS the call is refused before anything is launched."""
    device, _ = device_or_skip()
    x, w = make_inputs(1, 8, 4096, torch.bfloat16, device, seed=6)  # block_e 8 * H 4096
    ids = torch.full((1, 2), -7, dtype=torch.int32, device=device)
    tiles = RouterTiles(block_e_small=8, block_e=8)
    assert not tiles.early_weights_fit(8, 4096, 1) and RouterTiles().early_weights_fit(8, 4096, 1)
    with pytest.raises(ValueError, match="early_weights would hold 32768"):
        router_topk(x, w, 2, True, ids=ids, tiles=tiles, early_weights=True)
    assert bool((ids == -7).all())


def test_exact_ties_go_to_the_lower_id():
    """Identical router rows give bit-identical logits: the lower expert id must come first."""
    device, _ = device_or_skip()
    x, w = make_inputs(2, 12, 64, torch.bfloat16, device, seed=5)
    w = w.clone()
    along = (x[0].float() + x[1].float()) / x.shape[1]  # logit ~ 1 for both tokens
    w[9] = w[2] = (4 * along).to(w.dtype)  # experts 2 and 9 tie, far above the rest (logits ~ N(0, 1))
    w[6] = w[11] = (3 * along).to(w.dtype)  # experts 6 and 11 tie just below them
    weights, ids = router_topk(x, w, 4, False)
    want_w, want_i = router_reference(x, w, 4, False)
    assert torch.equal(ids.cpu(), want_i.cpu()), (ids, want_i)
    assert ids.tolist() == [[2, 9, 6, 11], [2, 9, 6, 11]]  # each tie: the lower id first
    # with pre, slots ride below the ids in the packed keys: a higher id's smaller slot changes nothing
    slot_of = torch.tensor([5, 0, 30, 1, 2, 3, 40, 4, 6, 1, 7, 0], dtype=torch.int32, device=device)
    out = torch.empty(2, 4, dtype=torch.int32, device=device)
    w_pre, i_pre = router_topk(x, w, 4, False, pre=(slot_of, 0, out))
    assert torch.equal(i_pre, ids) and torch.equal(w_pre, weights)
    assert out.tolist() == [[30, 1, 40, 0], [30, 1, 40, 0]]
    assert torch.equal(weights[:, 0], weights[:, 1]) and torch.equal(weights[:, 2], weights[:, 3])
    assert torch.allclose(weights.cpu(), want_w.cpu(), rtol=1e-5, atol=1e-6)


def test_deterministic():
    device, _ = device_or_skip()
    x, w = make_inputs(3, 24, 64, torch.bfloat16, device, seed=6)
    a, b = router_topk(x, w, 6, True), router_topk(x, w, 6, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _args():
    x, w = make_inputs(2, 8, 16, torch.bfloat16, "cpu", seed=0)
    return {"hidden": x, "router_w": w, "top_k": 2, "norm_topk_prob": True}


@pytest.mark.parametrize("name, bad", [
    ("hidden", torch.zeros(16, dtype=torch.bfloat16)),
    ("hidden", torch.zeros(GEMV_MAX_TOKENS + 1, 16, dtype=torch.bfloat16)),
    ("hidden", torch.zeros(2, 16, dtype=torch.int32)),
    ("router_w", torch.zeros(8, 16)),
    ("router_w", torch.zeros(8, 12, dtype=torch.bfloat16)),
    ("router_w", torch.zeros(16, 8, dtype=torch.bfloat16).T),
    ("top_k", 0), ("top_k", 9), ("top_k", True),
    ("weights", torch.zeros(2, 3)), ("weights", torch.zeros(2, 2, dtype=torch.float64)),
    ("ids", torch.zeros(2, 2, dtype=torch.int64)),
    ("tiles", "default"), ("early_weights", 1),
])
def test_bad_arguments_are_named(name, bad):
    args = {**_args(), name: bad}
    with pytest.raises(ValueError, match=name):
        router_topk(**args)


SM90_CHECK = r"""
import json, re
from moe.kernels.router import compile_router_for_target
assert compile_router_for_target(512, 2048, 10, "bf16", True, tokens=8).get("cubin")  # 4 experts a program
asm = compile_router_for_target(512, 2048, 10, "bf16", True)
ptx = asm["ptx"]
pdl = compile_router_for_target(512, 2048, 10, "bf16", True, pdl=True)["ptx"]
pre = [compile_router_for_target(512, 2048, 10, "bf16", norm, pdl=True, pre=True) for norm in (True, False)]
early = compile_router_for_target(512, 2048, 10, "bf16", True, pdl=True, early_weights=True)["ptx"]
def loads_before_wait(text):  # 16-byte loads issued before the programmatic wait
    wait = text.find("griddepcontrol.wait")
    return sum(1 for m in re.finditer(r"ld\.global(\.\w+)*\.v4\.b32", text) if m.start() < wait)
print(json.dumps([bool(asm.get("cubin")), bool(re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)),
                  "atom.global" in ptx, ".local" not in ptx,
                  "griddepcontrol.wait" not in ptx, "griddepcontrol.wait" in pdl,
                  all(bool(a.get("cubin")) and ".local" not in a["ptx"] for a in pre),
                  (loads_before_wait(pdl), loads_before_wait(early)) == (0, 4),
                  all(bool(a.get("cubin")) and ".local" not in a["ptx"]  # gpt-oss-20b's router, with its bias
                      for a in [compile_router_for_target(32, 2880, 4, "bf16", True, pdl=True, pre=pre, bias=True,
                                                          early_weights=early, tokens=t)
                                for pre, early, t in ((True, True, 1), (False, False, 8))]),
                  all(bool(a.get("cubin")) and ".local" not in a["ptx"]  # GLM-4.5-Air's, and a grouped one
                      for a in [compile_router_for_target(e, 4096, 8, "bf16", True, pdl=True, pre=True,
                                                          selection=dict(scoring="sigmoid", score_bias=True, n_group=g,
                                                                         topk_group=tg, scaling=sc))
                                for e, g, tg, sc in ((128, 1, 1, 1.0), (256, 8, 4, 2.5))])]))
"""


def test_compiles_for_sm90():
    """The router at the Qwen3-Next shape compiles for sm_90: 16-byte weight loads, the arrival atomic,
    no register spills (also with pre, with and without renormalisation); with early_weights the
    weights' four 16-byte loads per thread come before the programmatic wait (without it none). A
    child process without TRITON_INTERPRET (which replaces the compiler's hooks)."""
    assert (
        compile_check(SM90_CHECK) == [True] * 10
    )  # 5, 6: only router_topk(pdl=True) waits; 7: pre; 9: bias; 10: sigmoid


# ---------------------------------------------------------------- GPU: the Qwen3-Next shape


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8])
@pytest.mark.parametrize("shape", ["glm-4.5-air", "grouped"])
def test_gpu_sigmoid_router_at_real_shapes(tokens, shape):
    """GLM-4.5-Air's router (128 experts of H 4096, top-8, scaling 1) and a grouped one (256 experts in 8
    groups, 4 kept, top-8, scaling 2.5, as DeepSeek-V3-style configs of this family set)."""
    experts, hidden, groups, kept, scaling = (
        (128, 4096, 1, 1, 1.0) if shape == "glm-4.5-air" else (256, 2048, 8, 4, 2.5)
    )
    x, w = make_inputs(tokens, experts, hidden, torch.bfloat16, "cuda", seed=tokens)
    bias = 0.05 * torch.randn(experts, device="cuda")
    sel = dict(scoring="sigmoid", score_bias=bias, n_group=groups, topk_group=kept, scaling=scaling)
    got = router_topk(x, w, 8, True, **sel)
    want = route(x, w, 8, True, **sel)
    assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_gpt_oss_20b_shape_with_router_bias(tokens):
    x, w = make_inputs(tokens, 32, 2880, torch.bfloat16, "cuda", seed=tokens)
    bias = torch.randn(32, device="cuda").bfloat16()
    got = router_topk(x, w, 4, True, router_b=bias)
    check_against(got, router_reference(x, w, 4, True, bias), decisive(x, w, 4, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_qwen3_next_shape(tokens, norm):
    x, w = make_inputs(tokens, 512, 2048, torch.bfloat16, "cuda", seed=tokens)
    got = router_topk(x, w, 10, norm)
    check_against(got, router_reference(x, w, 10, norm), decisive(x, w, 10))
    again = router_topk(x, w, 10, norm)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_early_weights_change_no_bit(tokens):
    """early_weights with a programmatic launch behind a kernel that writes the hidden state: the
    same bits as the router without it, which reads everything after its wait."""
    x, w = make_inputs(tokens, 512, 2048, torch.bfloat16, "cuda", seed=40 + tokens)
    src = make_inputs(tokens, 512, 2048, torch.bfloat16, "cuda", seed=50 + tokens)[0]
    outs = []
    for early in (False, True):
        x.zero_()
        x.copy_(src)  # the predecessor writes the hidden state the router waits for
        outs.append(router_topk(x, w, 10, True, pdl=True, early_weights=early))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    check_against(outs[1], router_reference(src, w, 10, True), decisive(src, w, 10))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_resets_counters():
    x, w = make_inputs(4, 512, 2048, torch.bfloat16, "cuda", seed=21)
    weights = torch.empty(4, 10, device="cuda")
    ids = torch.empty(4, 10, dtype=torch.int32, device="cuda")
    router_topk(x, w, 10, True, weights=weights, ids=ids)  # compile, make the scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router_topk(x, w, 10, True, weights=weights, ids=ids)
    for seed in (22, 23, 24):
        x.copy_(make_inputs(4, 512, 2048, torch.bfloat16, "cuda", seed=seed)[0])
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        check_against((weights, ids), router_reference(x, w, 10, True), decisive(x, w, 10))
        assert not router_scratch("cuda", 512)[1].any()
