"""The decode engine on a GPU (GpuMoE + CUDA-graph decode) against Hugging Face transformers on the GPU.

    tiny random transformers checkpoints (tests/moe/engine/test_model.py's, every family) ─save─► dir
        ─load_model(dir, "cuda", dtype)─► Engine: MoELayer per MoE layer, decode steps as CUDA graphs
    compared, at slot counts that make every decode step miss and evict (asserted from the counters),
    for every policy (lru, rule, lfuda) with the copy overlap off and on (qwen3 has no shared expert:
its "on" runs only the early hits on the side stream; asserted; glm4_moe's shared expert is ungated):
      float32: greedy tokens identical for 8 steps (batch 2, unequal prompts) and every logit within
               1e-4 (relative to the largest) of transformers' float32
      bfloat16: teacher-forced logits within bf16 tolerance of transformers' own bf16 (the approach of
               test_model.py: 6 % of the largest logit, and no further from the float32 truth than
               transformers' bf16 run is) at every token both route alike; a decode token whose routing
               differs must differ first at a layer where it chose what transformers' float32 router
               chose, or where the logit gap it crossed is within the bf16 noise of transformers' own
               router there (twice the largest |bf16 - float32| router logit difference)
    graph replay against eager decode (cuda_graphs=False): bitwise equal logits, slot maps and recorded
    routing at batch 1 and 2, rows leaving and joining in between; recorded routing = the layers' own;
    overlap on against off through the same script: bitwise equal logits, slot maps and context state.

Why token identity is checked in float32: the engine's MoE kernels accumulate in float32 and round once,
while transformers rounds after every bf16 linear, so bf16 logits differ by up to a few per cent and
greedy choices between near-tied tokens would flip for reasons that are not bugs. In float32 both sides
are exact to ~1e-6, so any token mismatch is a real error, and the result does not depend on luck.
The same rounding differences can flip a routed expert where two router logits are within bf16's
resolution (the fused decode step rounds in other places than transformers; measured on the H200, 3 of
36 bf16 decode steps of two small random models), and a flipped expert moved that token's logits by 8-14 %
of the largest:
so the bf16 test compares values only where the routing agrees, and requires every disagreement to start
where the float32 router agrees with the engine or the crossed gap is within transformers' own bf16 noise.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from expertcache.host import MISSES
from moe.engine.loading import load_model
from moe.kernels.plan import OverlapMode
from moe.testing.tiny_checkpoint import randomize
from tests.moe.families import (
    COMMON,
    FAMILIES,
    assert_near,
    family_index,
    hf_logits_and_router,
    hf_run,
    moe_layers,
    num_experts,
    random_tokens,
    router_choice,
    routing_alike,
)

pytestmark = pytest.mark.gpu
POLICIES = ("lru", "rule", "lfuda")
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
POLICY = pytest.mark.parametrize("policy", POLICIES)
STEPS = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, {"float32": HF model on cuda, "bfloat16": its bf16 copy}, checkpoint dir), built once."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    randomize(model, seed=len(request.param) + family_index(request.param))
    path = tmp_path_factory.mktemp(f"gpu-{request.param}")
    model.save_pretrained(path, safe_serialization=True)
    models = {"float32": model.to("cuda"), "bfloat16": copy.deepcopy(model).to("cuda", torch.bfloat16)}
    return request.param, models, path


def _engine(path, k: int, dtype: str, policy: str, overlap: bool, batch: int = 2, **kw):
    """A GPU engine whose pool holds batch * top_k slots: every decode step misses and evicts."""
    return load_model(path, "cuda", num_slots=batch * k, policy=policy, dtype=dtype, max_batch=batch,
                      max_seq_len=64, progress=False, copy_overlap=overlap, **kw)


def _check_overlap(engine, overlap: bool) -> None:
    """The side stream is used exactly when asked for: the early hits (the resident experts' gate_up:
    the pool holds batch * top_k slots, fewer than the experts) and the shared expert where the block
    has one (qwen2; qwen3 has none)."""
    moe = engine.spec.moe
    on = OverlapMode.SHARED_AND_HITS_ON_SIDE if moe.has_shared_expert else OverlapMode.HITS_ON_SIDE
    for layer in engine.moe.layers.values():
        assert layer.plan.mode is (on if overlap else OverlapMode.INLINE), layer.plan.reason


def _misses(engine) -> int:
    return int(engine.moe.slots.cache.stats()["total_misses"])


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq], device="cuda")).logits[0].float()  # [T, V]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@POLICY
@OVERLAP
def test_float32_greedy_tokens_and_logits_match_transformers(family, policy, overlap):
    name, models, path = family
    hf, k = models["float32"], models["float32"].config.num_experts_per_tok
    engine = _engine(path, k, "float32", policy, overlap)
    assert engine.graphs is not None
    _check_overlap(engine, overlap)
    _greedy_matches(engine, hf, [random_tokens(5, seed=20), random_tokens(7, seed=21)])
    assert engine.graphs.batch_sizes == [2]


def _greedy_matches(engine, hf, prompts: list[list[int]]) -> None:
    """STEPS greedy tokens of the engine (every decode step missing) identical to transformers', and
    the logits of each step within 1e-4 of transformers' on the same tokens."""
    logits = [engine.prefill(prompts)]  # [2, V] per step
    tokens = [logits[0].argmax(dim=-1)]
    for _ in range(STEPS - 1):
        before = _misses(engine)
        logits.append(engine.decode_step(tokens[-1]))
        tokens.append(logits[-1].argmax(dim=-1))
        assert _misses(engine) > before, "every decode step must miss (and evict: the pool is full)"
    got = torch.stack(tokens, dim=1).tolist()  # [2, STEPS]
    for row, prompt in enumerate(prompts):
        assert got[row] == _hf_greedy(hf, prompt, STEPS), f"row {row}"
        ref = hf_logits(hf, prompt + got[row][:-1])[len(prompt) - 1:]  # [STEPS, V]
        assert_near(torch.stack([step[row] for step in logits]), ref, rel=1e-4)


@POLICY
@OVERLAP
def test_bfloat16_logits_within_bf16_tolerance(family, policy, overlap):
    name, models, path = family
    k = models["float32"].config.num_experts_per_tok
    engine = _engine(path, k, "bfloat16", policy, overlap, record_routing=True)
    _check_overlap(engine, overlap)
    seqs = [random_tokens(10, seed=30), random_tokens(12, seed=31)]
    plen = [5, 7]  # then 5 teacher-forced decode steps per row
    first = engine.prefill([s[:n] for s, n in zip(seqs, plen)], all_logits=True)  # 2 x [T_b, V]
    steps = []
    for j in range(5):
        before = _misses(engine)
        steps.append(engine.decode_step([seqs[0][plen[0] + j], seqs[1][plen[1] + j]]))
        assert _misses(engine) > before, "every decode step must miss (and evict: the pool is full)"
    ours = torch.as_tensor(engine.routing())  # [5, L, 2, k]: each decode step's routed ids
    for row, seq in enumerate(seqs):
        got = torch.cat([first[row], torch.stack([s[row] for s in steps])])  # [T, V]
        ref32 = hf_logits(models["float32"], seq)
        ref16, router16 = hf_logits_and_router(models["bfloat16"], seq)
        router32 = hf_logits_and_router(models["float32"], seq)[1]
        alike = [True] * plen[row] + [routing_alike(ours[j, :, row], router16[:, t], router32[:, t], k)
                                      for j, t in enumerate(range(plen[row], len(seq)))]
        assert sum(alike) >= len(seq) - 2, (row, alike)  # a flip is rare: at most 2 tokens of 10-12
        keep = torch.tensor(alike, device=got.device)
        assert_near(got[keep], ref16[keep], rel=0.06)
        own, theirs = (got - ref32).abs().mean().item(), (ref16 - ref32).abs().mean().item()
        assert own <= 1.5 * theirs + 2**-8 * ref32.abs().mean().item(), (row, own, theirs)


def _run_script(engine, family_tokens: list[list[int]]) -> list[torch.Tensor]:
    """Prefill two prompts, 3 steps at batch 2, row 0 leaves, 2 steps at batch 1, a third prompt joins,
    3 steps at batch 2; teacher-forced from family_tokens (3 sequences). Returns every step's logits."""
    a, b, c = family_tokens
    out = [engine.prefill([a[:4], b[:6]])]
    feed = {"a": 4, "b": 6, "c": 5}

    def step(rows):
        toks = [{"a": a, "b": b, "c": c}[r][feed[r]] for r in rows]
        for r in rows:
            feed[r] += 1
        out.append(engine.decode_step(toks))

    for _ in range(3):
        step(["a", "b"])
    assert engine.leave(0) == 1  # b moves into row 0
    for _ in range(2):
        step(["b"])
    row, first = engine.join(c[:5])
    assert row == 1
    out.append(first[None])
    for _ in range(3):
        step(["b", "c"])
    return out


@OVERLAP
def test_graph_replay_bitwise_equals_eager_through_leave_and_join(family, overlap):
    name, models, path = family
    k = models["float32"].config.num_experts_per_tok
    seqs = [random_tokens(12, seed=40), random_tokens(14, seed=41), random_tokens(12, seed=42)]
    runs = {}
    for graphs in (False, True):
        engine = _engine(path, k, "bfloat16", "rule", overlap, cuda_graphs=graphs, record_routing=True)
        assert (engine.graphs is not None) == graphs
        runs[graphs] = (engine, _run_script(engine, seqs))
    (eager, out_e), (graph, out_g) = runs[False], runs[True]
    assert graph.graphs.batch_sizes == [1, 2]
    assert len(out_e) == len(out_g)
    for n, (x, y) in enumerate(zip(out_e, out_g)):
        assert torch.equal(x, y), f"step {n}: graph replay differs from eager decode"
    ce, cg = eager.moe.slots.cache, graph.moe.slots.cache
    assert torch.equal(ce.slot_of, cg.slot_of) and torch.equal(ce.key_of, cg.key_of)
    assert torch.equal(ce.counters, cg.counters)
    assert (cg.counters[:, MISSES] > 0).all(), "the pool of batch * top_k slots must miss in every layer"
    assert (eager.routing() == graph.routing()).all()


def test_overlap_on_and_off_decode_bitwise_equal_while_evicting(family):
    """The side stream changes where work runs, not a bit of the result: bf16 CUDA-graph decode through
    the leave / join script, every step missing and evicting, with the overlap off and on: logits,
    slot maps, counters and the context state (KV, and a linear-attention layer's recurrent state) bitwise."""
    name, models, path = family
    k = models["float32"].config.num_experts_per_tok
    seqs = [random_tokens(12, seed=43), random_tokens(14, seed=44), random_tokens(12, seed=45)]
    runs = []
    for overlap in (False, True):
        engine = _engine(path, k, "bfloat16", "lru", overlap)
        _check_overlap(engine, overlap)
        runs.append((engine, _run_script(engine, seqs)))
    (off, out_off), (on, out_on) = runs
    for n, (x, y) in enumerate(zip(out_off, out_on, strict=True)):
        assert torch.equal(x, y), f"step {n}: overlap on differs from overlap off"
    c_off, c_on = off.moe.slots.cache, on.moe.slots.cache
    assert torch.equal(c_off.slot_of, c_on.slot_of) and torch.equal(c_off.counters, c_on.counters)
    assert (c_on.counters[:, MISSES] > 0).all()
    for x, y in zip(off.context_state(), on.context_state(), strict=True):
        assert torch.equal(x, y)


@OVERLAP
def test_recorded_routing_is_the_layers_routing(family, overlap):
    name, models, path = family
    k = models["float32"].config.num_experts_per_tok
    engine = _engine(path, k, "float32", "lru", overlap, record_routing=True)
    seqs = [random_tokens(9, seed=50), random_tokens(11, seed=51)]
    engine.prefill([seqs[0][:5], seqs[1][:7]])
    for j in range(4):
        engine.decode_step([seqs[0][5 + j], seqs[1][7 + j]])
        last = engine.routing()[-1]  # [L_moe, 2, k], a clone taken after the replay
        for m, layer in sorted(engine.moe.layers.items()):
            assert last[m].tolist() == layer.last_routing(2)[1].tolist(), (j, m)
    routing = engine.routing()
    assert routing.shape == (4, engine.spec.num_moe_layers, 2, k)
    with torch.no_grad():  # and they are transformers' router top-k (float32: no near ties at this size)
        for row, (seq, plen) in enumerate(zip(seqs, (5, 7))):
            router = hf_run(models["float32"], seq)[1]
            for m, choice in enumerate(router_choice(models["float32"], router)):  # [T, E] per MoE layer
                ref = choice[plen:plen + 4].topk(k, dim=-1).indices.cpu().numpy()
                assert (routing[:, m, row] == ref).all(), (row, m)


def test_no_garbage_collection_runs_inside_a_decode_capture():
    """CUDA objects of dead reference cycles (an old engine's graphs: engine -> DecodeGraphs -> step,
    a bound method -> engine) are freed before a capture, and the collector never runs inside it, where
    destroying them (cudaGraphExecDestroy) invalidates the capture (docs/engine.md, "CUDA graphs per
    batch size": the engine tests run in one process failed that way without it)."""
    import gc
    import weakref

    from moe.engine.graphs import DecodeGraphs

    class Node:
        pass

    dead = Node()
    dead.self = dead  # a cycle: only the collector frees it
    alive_at_capture, collections_in_capture = [], []
    ref = weakref.ref(dead)
    del dead
    x = torch.arange(4, device="cuda", dtype=torch.float32)

    def step(t):
        if torch.cuda.is_current_stream_capturing():
            alive_at_capture.append(ref() is not None)
            _ = [[] for _ in range(2000)]  # with threshold 1, thousands of collections if allowed
        return x[: t.shape[0]] + t.float(), None

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            collections_in_capture.append(info["generation"])

    graphs, tokens = DecodeGraphs(step, 4, torch.device("cuda")), torch.ones(2, dtype=torch.int64, device="cuda")
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(watch)
    try:
        graphs.run(tokens)  # the eager step, then the capture
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    out, _ = graphs.run(tokens)  # a replay
    torch.cuda.synchronize()
    assert alive_at_capture == [False] and collections_in_capture == []
    assert torch.equal(out, x[:2] + 1) and gc.isenabled()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int4", "mxfp4"])
@OVERLAP
def test_quantized_experts_greedy_tokens_match_transformers_on_the_decoded_experts(family, fmt, overlap, tmp_path):
    """--moe-expert-format on the float32 checkpoint, the cache evicting every step: greedy tokens identical
    to, and logits within 1e-4 of, transformers running the same checkpoint with every expert replaced by
    the format's decode of its quantize (gate_proj, up_proj, down_proj each alone)."""
    from safetensors.torch import load_file

    from expertcache.formats import get_format
    from tests.moe.families import broken_copy

    name, models, path = family
    f = get_format(fmt)
    tensors = load_file(str(path / "model.safetensors"))
    routed = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")  # Mixtral's: w1 / w3 / w2
    decoded = {n: f.dequantize(f.quantize(t)) for n, t in tensors.items() if routed.search(n)}
    assert len(decoded) == 3 * num_experts(models["float32"].config) * moe_layers(models["float32"].config)
    hf = type(models["float32"]).from_pretrained(broken_copy(path, tmp_path, lambda t: t.update(decoded)),
                                                 dtype=torch.float32).to("cuda").eval()
    k = hf.config.num_experts_per_tok
    engine = _engine(path, k, "float32", "lru", overlap, expert_format=fmt)
    assert engine.spec.moe.expert_format == fmt
    _check_overlap(engine, overlap)
    _greedy_matches(engine, hf, [random_tokens(5, seed=40), random_tokens(7, seed=41)])


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8", "mxfp4"])
def test_tensor_core_routed_kernels_greedy_tokens_match_transformers(family, fmt, tmp_path, monkeypatch):
    """EXPERTCACHE_ROUTED_MMA=1 (moe.kernels.routed_mma): the float32 checkpoint's experts in `fmt`, the
    cache evicting every step: greedy tokens identical to transformers on the decoded experts, logits
    within 1e-4; then bf16 decode in CUDA graphs bitwise equal to eager."""
    from safetensors.torch import load_file

    from expertcache.formats import get_format
    from moe.model.config import ROUTED_MMA_ENV
    from tests.moe.families import broken_copy

    monkeypatch.setenv(ROUTED_MMA_ENV, "1")
    name, models, path = family
    f = get_format(fmt)
    tensors = load_file(str(path / "model.safetensors"))
    routed = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
    decoded = {n: f.dequantize(f.quantize(t)) for n, t in tensors.items() if routed.search(n)}
    hf = type(models["float32"]).from_pretrained(broken_copy(path, tmp_path, lambda t: t.update(decoded)),
                                                 dtype=torch.float32).to("cuda").eval()
    k = hf.config.num_experts_per_tok
    engine = _engine(path, k, "float32", "lru", True, expert_format=fmt)
    assert all(layer.plan.routed_mma is not None and not layer.plan.mode.hits_on_side
               for layer in engine.moe.layers.values())
    _greedy_matches(engine, hf, [random_tokens(5, seed=40), random_tokens(7, seed=41)])
    seqs = [random_tokens(12, seed=42), random_tokens(14, seed=43), random_tokens(12, seed=44)]
    runs = [_run_script(_engine(path, k, "bfloat16", "rule", True, cuda_graphs=graphs, expert_format=fmt), seqs)
            for graphs in (False, True)]
    for n, (x, y) in enumerate(zip(*runs)):
        assert torch.equal(x, y), f"step {n}: graph replay differs from eager decode"
