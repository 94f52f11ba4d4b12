"""The MoE decode layer against the torch reference, and the side-stream overlap against the
single-stream sequence, bit for bit.

CPU (Triton's interpreter, tiny shapes): layer vs moe.model.reference over steps that evict every time,
with and without a shared expert; the launch plan the layer resolves, its reasons, an explicit plan;
the plan's releases against none, bitwise; rebuild; argument errors.
GPU (`gpu`): overlap on vs off bitwise (outputs, slot map, filled slots) for batch 1 and 2, eager and
CUDA graph, and every launch choice of the plan against its alternative (early hits, PDL, each
release); kernel placement and the launch count from a profiler trace; the side stream across a
pool rebuild.

The layer routes with the Triton router (float32 sums in its own order), the reference with torch:
where a row's k-th and (k+1)-th probabilities nearly tie, the two may pick different experts, so
outputs are compared on the rows whose top-k set is decided by a clear margin (at least half the rows
and one per layer must be).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import moe.engine.layer
from moe.kernels.plan import GEMV_MAX_TOKENS, LaunchPlan, OverlapMode, resolve_launch_plan
from moe.model.config import MoEConfig
from moe.model.reference import route
from moe.testing.kernel_trace import kernels, kernels_in_range, load_trace, named
from moe.testing.synthetic import SyntheticModel, random_weights

# The CPU model runs its Triton kernels in the interpreter, which is on only where CUDA is absent
# (cpu_only); on a GPU machine the gpu tests below cover the same checks.
BF16 = torch.bfloat16
# H, E, I, k, Is; L layers over S slots: every step asks for more keys than the pool holds
CPU_CFG = MoEConfig(hidden=64, num_experts=16, top_k=4, expert_intermediate=32, shared_intermediate=32,
                    norm_topk_prob=True)
CPU_L, CPU_S = 2, 10
GPU_CFG = MoEConfig(hidden=512, num_experts=64, top_k=6, expert_intermediate=256, shared_intermediate=256)
GPU_L, GPU_S = 3, 16


MARGIN = 1e-4  # relative gap between the k-th and (k+1)-th probabilities that summation order cannot close


def decisive_rows(hidden: torch.Tensor, router_w: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] bool: rows whose top-k expert set is decided by more than MARGIN (relative)."""
    probs = torch.softmax(hidden.float() @ router_w.float().T, dim=-1)  # [T, E]
    if top_k == probs.shape[-1]:
        return torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    top = torch.topk(probs, top_k + 1, dim=-1).values
    return (top[:, top_k - 1] - top[:, top_k]) > MARGIN * top[:, top_k - 1]


def close_to_reference(model: SyntheticModel, x: torch.Tensor, min_share: float = 0.5) -> None:
    """One step; every layer's output within bf16 tolerance of moe_reference on its own input, on the
    decisive rows; every layer must have a decisive row and at least `min_share` of all rows must be
    decisive (so the check is never vacuous; a near-tie is rare, but a 6-row step can hold one, as
    a GPU run with 64 experts, top-6, showed)."""
    inp, decided, rows = x, 0, 0
    for layer, out in enumerate(model.step_layers(x)):
        ref = model.reference(layer, inp).float()
        keep = decisive_rows(inp, model.layers[layer].router_w, model.cfg.top_k)
        tol = 2e-2 * max(1.0, float(ref.abs().max()))
        err = float((out.float() - ref)[keep].abs().max()) if bool(keep.any()) else 0.0
        assert err <= tol, (layer, err, tol)
        assert bool(keep.any()), f"layer {layer}: no row routes by a clear margin"
        decided, rows = decided + int(keep.sum()), rows + keep.numel()
        inp = out
    assert decided >= min_share * rows, f"only {decided} of {rows} rows route by a clear margin"


def misses(model: SyntheticModel) -> int:
    return int(model.slots.cache.stats()["total_misses"])


def plan_for(cfg: MoEConfig, num_slots: int, num_keys: int, device: str, overlap: bool, **fields) -> LaunchPlan:
    """The plan a layer of `cfg` resolves over num_slots of num_keys on `device` (132 SMs on CUDA:
    only the early hits' grid size depends on it), with `fields` replaced."""
    plan = resolve_launch_plan(cfg, num_slots=num_slots, num_keys=num_keys, device=device,
                               num_sms=torch.cuda.get_device_properties(0).multi_processor_count
                               if device.startswith("cuda") else 4, copy_overlap=overlap)
    return dataclasses.replace(plan, **fields)


def without_releases(plan: LaunchPlan, top_k: int, prefetch: int | None = None) -> LaunchPlan:
    """`plan` with no release, no early router weights and down_prefetch min(4, k) (or `prefetch`):
    the launches before any front release existed."""
    return dataclasses.replace(plan, front_release=False,
                               router_early_weights=(False,) * GEMV_MAX_TOKENS,
                               down_prefetch=min(4, top_k) if prefetch is None else prefetch)


@pytest.mark.cpu_only
def test_warm_all_makes_every_expert_resident_cpu():
    """SyntheticModel.warm_all (the bench's resident mode): every key of every layer in a slot holding its
    expert's bytes, top_k ids per ensure (E = 18 is no multiple of k = 4: the last call is padded);
    a pool smaller than L * E is refused by name."""
    cfg = dataclasses.replace(CPU_CFG, num_experts=18)
    weights = random_weights(cfg, CPU_L, "cpu", seed=41)
    model = SyntheticModel(weights, CPU_L * 18, "cpu")
    model.warm_all()
    cache, pool = model.slots.cache, model.slots.pool
    slot_of = cache.slot_of.long()
    assert bool((slot_of >= 0).all()) and len(set(slot_of.tolist())) == CPU_L * 18
    for bank in ("gate_up", "down"):
        assert torch.equal(pool.tensor(bank)[slot_of], weights.store.tensor(bank))
    assert misses(model) == CPU_L * 18
    with pytest.raises(ValueError, match="--slots"):
        SyntheticModel(weights, CPU_L * 18 - 1, "cpu").warm_all()


@pytest.mark.cpu_only
@pytest.mark.parametrize("shared, norm", [(32, True), pytest.param(0, False, marks=pytest.mark.slow)],
                         ids=["shared", "no-shared"])
def test_layer_matches_reference_cpu(shared, norm):
    cfg = dataclasses.replace(CPU_CFG, shared_intermediate=shared, norm_topk_prob=norm)
    model = SyntheticModel(random_weights(cfg, CPU_L, "cpu", seed=7), CPU_S, "cpu", copy_overlap=True)
    assert model.layers[0].plan.mode is OverlapMode.INLINE
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        before = misses(model)
        close_to_reference(model, torch.randn(2, cfg.hidden, generator=gen).to(BF16))
        assert misses(model) > before, "every step must miss (and evict)"


def test_overlap_decision_and_reasons_cpu(monkeypatch):
    monkeypatch.delenv("EXPERTCACHE_MOE_COPY_OVERLAP", raising=False)
    weights = random_weights(CPU_CFG, CPU_L, "cpu", seed=0)
    off = SyntheticModel(weights, CPU_S, "cpu")
    assert off.cfg.copy_overlap is False and "EXPERTCACHE_MOE_COPY_OVERLAP" in off.layers[0].plan.reason
    monkeypatch.setenv("EXPERTCACHE_MOE_COPY_OVERLAP", "1")
    on = SyntheticModel(weights, CPU_S, "cpu")
    assert on.cfg.copy_overlap is True and "cpu" in on.layers[0].plan.reason
    assert on.layers[0].side is None and on.slots.side is None
    no_shared = random_weights(dataclasses.replace(CPU_CFG, shared_intermediate=0), CPU_L, "cpu")
    full = SyntheticModel(no_shared, CPU_L * CPU_CFG.num_experts, "cpu")
    assert "nothing to run on the side stream" in full.layers[0].plan.reason
    hits = SyntheticModel(no_shared, CPU_S, "cpu")
    assert "cpu" in hits.layers[0].plan.reason  # early hits are side-stream work: only the device declines


def test_layer_resolves_its_plan_and_keeps_a_given_one_cpu():
    """The layer's plan is resolve_launch_plan's for its pool, re-resolved by a rebuild; a plan given
    at construction is used and kept through rebuilds; one the layer cannot launch is refused by name."""
    weights = random_weights(CPU_CFG, CPU_L, "cpu", seed=3)
    keys = CPU_L * CPU_CFG.num_experts
    model = SyntheticModel(weights, CPU_S, "cpu", copy_overlap=True)
    assert model.layers[1].plan == plan_for(model.cfg, CPU_S, keys, "cpu", True)
    assert model.layers[0].plan.front_release and model.layers[0].plan.down_prefetch == 2  # no early hits on a CPU
    model.rebuild(keys)
    assert model.layers[0].plan == plan_for(model.cfg, keys, keys, "cpu", True)
    given = without_releases(model.layers[0].plan, CPU_CFG.top_k)
    fixed = SyntheticModel(weights, CPU_S, "cpu", plan=given)
    fixed.rebuild(keys)
    assert all(layer.plan is given for layer in fixed.layers)
    with pytest.raises(ValueError, match="side stream"):
        SyntheticModel(weights, CPU_S, "cpu", plan=dataclasses.replace(given, mode=OverlapMode.SHARED_ON_SIDE))
    no_shared = random_weights(dataclasses.replace(CPU_CFG, shared_intermediate=0), CPU_L, "cpu")
    with pytest.raises(ValueError, match="shared_intermediate=0"):
        SyntheticModel(no_shared, CPU_S, "cpu", plan=dataclasses.replace(given, mode=OverlapMode.SHARED_ON_SIDE))


@pytest.mark.cpu_only
def test_last_routing_is_the_routers_output_cpu():
    """The ids the layer routed with equal the torch router's on decisive rows, and ensure got them."""
    model = SyntheticModel(random_weights(CPU_CFG, CPU_L, "cpu", seed=4), CPU_S, "cpu")
    x = torch.randn(2, CPU_CFG.hidden, generator=torch.Generator().manual_seed(8)).to(BF16)
    layer = model.layers[0]
    layer(x)
    weights, ids = layer.last_routing(2)
    want_w, want_i = route(x, layer.router_w, CPU_CFG.top_k, CPU_CFG.norm_topk_prob)
    keep = decisive_rows(x, layer.router_w, CPU_CFG.top_k)
    assert bool(keep.all())  # the same top-k sets (their order may differ only between near-equal weights)
    assert torch.equal(ids.sort(dim=-1).values, want_i.sort(dim=-1).values)
    assert torch.allclose(weights, want_w, rtol=1e-5, atol=1e-6)  # both descending
    keys = set(ids.flatten().tolist())  # layer 0: key = expert id
    assert keys <= set(model.slots.cache.key_of.tolist()), "every routed expert is resident after the call"
    with pytest.raises(ValueError, match="tokens"):
        layer.last_routing(0)


@pytest.mark.cpu_only
def test_rebuild_cold_starts_and_stays_correct_cpu():
    model = SyntheticModel(random_weights(CPU_CFG, CPU_L, "cpu", seed=2), CPU_S, "cpu")
    gen = torch.Generator().manual_seed(3)
    model.step(torch.randn(1, CPU_CFG.hidden, generator=gen).to(BF16))
    old = model.slots.cache
    model.rebuild(CPU_S + 3)
    assert model.slots.cache is not old and model.slots.pool.num_slots == CPU_S + 3
    assert misses(model) == 0 and bool((model.slots.cache.key_of == -1).all())
    close_to_reference(model, torch.randn(2, CPU_CFG.hidden, generator=gen).to(BF16))


def test_bad_arguments_name_the_field():
    weights = random_weights(CPU_CFG, CPU_L, "cpu", seed=0)
    model = SyntheticModel(weights, CPU_S, "cpu")
    with pytest.raises(ValueError, match="hidden must be"):
        model.layers[0](torch.zeros(9, CPU_CFG.hidden, dtype=BF16))
    with pytest.raises(ValueError, match="MoEConfig.dtype"):
        model.layers[0](torch.zeros(1, CPU_CFG.hidden))
    before = model.slots.cache.snapshot()
    with pytest.raises(ValueError, match="--moe-slots"):  # 3 tokens * top-4 > 10 slots
        model.layers[0](torch.zeros(3, CPU_CFG.hidden, dtype=BF16))
    assert model.slots.cache.snapshot().equals(before)
    with pytest.raises(ValueError, match="shared_intermediate"):
        type(model.layers[0])(CPU_CFG, 0, weights.router[0], model.slots, None)
    with pytest.raises(ValueError, match="router_w"):
        type(model.layers[0])(CPU_CFG, 0, weights.router[0][:, :8], model.slots, weights.shared[0])


# ---------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def gpu_weights():
    return random_weights(GPU_CFG, GPU_L, "cuda", seed=11)


class Runner:
    """A model's step, eager or as one captured CUDA graph of all layers (static input, new data copied in)."""

    def __init__(self, model: SyntheticModel, graph: bool, tokens: int, warm: list[torch.Tensor]) -> None:
        self.model, self.graph = model, None
        for x in warm:  # compiles every kernel and makes every buffer before capture
            model.step(x)
        torch.cuda.synchronize()
        if graph:
            self.static_in = torch.zeros(tokens, GPU_CFG.hidden, dtype=BF16, device="cuda")
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = model.step(self.static_in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            return self.model.step(x)
        self.static_in.copy_(x)
        self.graph.replay()
        return self.static_out.clone()


def state(model: SyntheticModel) -> dict[str, torch.Tensor]:
    """slot_of, key_of and the bytes of every filled slot (every bank of the experts' format)."""
    cache, pool = model.slots.cache, model.slots.pool
    filled = torch.nonzero(cache.key_of >= 0).flatten()
    out = {"slot_of": cache.slot_of.clone(), "key_of": cache.key_of.clone()}
    for bank in pool.banks:
        t = pool.tensor(bank.name)
        out[bank.name] = t.view(t.shape[0], -1).view(torch.uint8)[filled].clone()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_overlap_on_off_bitwise(gpu_weights, graph, tokens):
    off = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=False)
    on = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=True)
    assert off.layers[0].plan.mode is OverlapMode.INLINE
    assert on.layers[0].plan.mode is OverlapMode.SHARED_AND_HITS_ON_SIDE, on.layers[0].plan.reason
    assert_steps_bitwise(off, on, graph, tokens, seed=tokens)
    on.close()


def assert_steps_bitwise(a_model: SyntheticModel, b_model: SyntheticModel, graph: bool, tokens: int,
                         seed: int, b_context=contextlib.nullcontext, a_context=contextlib.nullcontext,
                         must_miss: bool = True) -> None:
    """Eight steps of the same random inputs through both models (two to warm up / capture): every
    step misses in b_model (unless not must_miss), and the outputs, slot maps and slot contents are
    equal bit for bit. b_context / a_context: entered around b_model's / a_model's capture and every
    call of it."""
    gen = torch.Generator("cuda").manual_seed(seed)
    xs = [torch.randn(tokens, GPU_CFG.hidden, generator=gen, device="cuda").to(BF16) for _ in range(8)]
    with a_context():
        run_a = Runner(a_model, graph, tokens, xs[:2])
    with b_context():
        run_b = Runner(b_model, graph, tokens, xs[:2])
    for x in xs[2:]:
        before = misses(b_model)
        with a_context():
            a = run_a(x)
        with b_context():
            b = run_b(x)
        torch.cuda.synchronize()
        assert misses(b_model) > before or not must_miss, "every step must miss (and evict)"
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        sa, sb = state(a_model), state(b_model)
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_resident_pool_defaults_bitwise(gpu_weights, graph):
    """A pool that holds every expert: the plans resolve to no early hits and the front release on,
    overlap on and off, and change no bit against the plan of a pool that cannot hold them (early hits
    on, no release) and against the overlap off without releases, while the pool fills and once every
    expert is resident; eager and graph."""
    keys = GPU_L * GPU_CFG.num_experts
    off = SyntheticModel(gpu_weights, keys, "cuda", copy_overlap=False)
    on = SyntheticModel(gpu_weights, keys, "cuda", copy_overlap=True)
    assert on.layers[0].plan.mode is OverlapMode.SHARED_ON_SIDE, on.layers[0].plan.reason
    for model in (off, on):
        assert model.layers[0].plan.front_release
    early = plan_for(on.cfg, keys - 1, keys, "cuda", True)
    assert early.mode is OverlapMode.SHARED_AND_HITS_ON_SIDE and not early.front_release
    plain = SyntheticModel(gpu_weights, keys, "cuda", copy_overlap=True, plan=early)
    assert_steps_bitwise(plain, on, graph, 2, seed=37, must_miss=False)
    plain_off = SyntheticModel(gpu_weights, keys, "cuda", plan=without_releases(off.layers[0].plan, GPU_CFG.top_k))
    assert_steps_bitwise(plain_off, off, graph, 2, seed=41, must_miss=False)
    for model in (plain, plain_off, off, on):
        model.close()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_chain_bitwise(gpu_weights, graph, overlap):
    """LaunchPlan.pdl (router, ensure and miss copy launched programmatically) changes no bit:
    outputs, slot maps and slot contents, with evictions every step, eager and in a CUDA graph."""
    chain = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=overlap)  # the resolved plan
    assert chain.layers[0].plan.pdl
    plain = SyntheticModel(gpu_weights, GPU_S, "cuda", plan=dataclasses.replace(chain.layers[0].plan, pdl=False))
    assert_steps_bitwise(plain, chain, graph, 2, seed=7)
    plain.close()
    chain.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_no_shared_expert_early_hits_bitwise(graph):
    """A block without a shared expert (Qwen3-MoE, Mixtral) still overlaps with early hits: the side
    stream runs only the resident experts' gate_up; bitwise equal to the overlap off."""
    weights = random_weights(dataclasses.replace(GPU_CFG, shared_intermediate=0), GPU_L, "cuda", seed=17)
    off = SyntheticModel(weights, GPU_S, "cuda", copy_overlap=False)
    on = SyntheticModel(weights, GPU_S, "cuda", copy_overlap=True)
    assert on.layers[0].plan.mode is OverlapMode.HITS_ON_SIDE, on.layers[0].plan.reason
    assert off.layers[0].plan.mode is OverlapMode.INLINE
    assert_steps_bitwise(off, on, graph, 2, seed=19)
    on.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_early_hits_bitwise(gpu_weights, graph):
    """The early hits (the resident experts' gate_up on the side stream, the rest after the copy)
    change no bit against the overlap without them (the plan of a pool that holds every expert),
    with evictions every step."""
    early = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=True)
    keys = GPU_L * GPU_CFG.num_experts
    assert early.layers[0].plan.mode is OverlapMode.SHARED_AND_HITS_ON_SIDE  # the pool cannot hold every expert
    plain = SyntheticModel(gpu_weights, GPU_S, "cuda", plan=plan_for(early.cfg, keys, keys, "cuda", True))
    assert plain.layers[0].plan.mode is OverlapMode.SHARED_ON_SIDE
    assert_steps_bitwise(plain, early, graph, 2, seed=13)
    plain.close()
    early.close()


RELEASES = {"fr": {"front_release": True}, "rw": {"router_early_weights": (True,) * GEMV_MAX_TOKENS},
            "fr+rw": {"front_release": True, "router_early_weights": (True,) * GEMV_MAX_TOKENS},
            "pf1": {"down_prefetch": 1}, "pf4": {"down_prefetch": 4},
            "fr+rw+pf2": {"front_release": True, "router_early_weights": (True,) * GEMV_MAX_TOKENS,
                          "down_prefetch": 2}}


@pytest.mark.gpu
@pytest.mark.parametrize("options", list(RELEASES))
@pytest.mark.parametrize("overlap", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_releases_bitwise(gpu_weights, graph, overlap, options):
    """LaunchPlan.front_release (the next layer's router started by the down right after its wait, the
    gate_up launched right after the miss copy's wait, while it copies), router_early_weights (the
    router loading its weights before its wait) and down_prefetch (the down's slots and first weight
    tiles before its wait), alone and together, change no bit against
    the plan with none of them, overlap off and on (early hits on the side stream), with evictions
    every step, so every layer's router runs while the layer before it may still be writing; eager
    and in a CUDA graph."""
    resolved = plan_for(GPU_CFG, GPU_S, GPU_L * GPU_CFG.num_experts, "cuda", overlap)
    base = without_releases(resolved, GPU_CFG.top_k, prefetch=0)
    plain = SyntheticModel(gpu_weights, GPU_S, "cuda", plan=without_releases(
        plan_for(GPU_CFG, GPU_S, GPU_L * GPU_CFG.num_experts, "cuda", False), GPU_CFG.top_k, prefetch=0))
    early = SyntheticModel(gpu_weights, GPU_S, "cuda", plan=dataclasses.replace(base, **RELEASES[options]))
    assert_steps_bitwise(plain, early, graph, 2, seed=29)
    plain.close()
    early.close()


@pytest.mark.cpu_only
def test_releases_match_none_cpu(monkeypatch):
    """The resolved plan's releases (front_release, router_early_weights, down_prefetch=2: a CPU layer
    never runs early hits, so all on) on the CPU interpreter: outputs, slot
    maps and pool equal to the plan with none, with evictions every step; the copy is asked to
    release the gate_up after its wait and the router to load its weights early only by that plan."""
    asked = []
    real_copy, real_router = moe.engine.layer.miss_copy, moe.engine.layer.router_topk

    def spy_copy(*args, **kw):
        asked.append(("copy_release", kw["release_after_wait"]))
        return real_copy(*args, **kw)

    def spy_router(*args, **kw):
        asked.append(("early_weights", kw["early_weights"]))
        return real_router(*args, **kw)

    monkeypatch.setattr(moe.engine.layer, "miss_copy", spy_copy)
    monkeypatch.setattr(moe.engine.layer, "router_topk", spy_router)
    weights = random_weights(CPU_CFG, CPU_L, "cpu", seed=31)
    early = SyntheticModel(weights, CPU_S, "cpu")
    resolved = early.layers[0].plan
    assert resolved.front_release and resolved.down_prefetch == 2
    plain = SyntheticModel(weights, CPU_S, "cpu", plan=without_releases(resolved, CPU_CFG.top_k, prefetch=0))
    gen = torch.Generator().manual_seed(32)
    for _ in range(2):
        x = torch.randn(2, CPU_CFG.hidden, generator=gen).to(BF16)
        before = misses(early)
        asked.clear()
        a = plain.step(x)
        assert asked == [("early_weights", False), ("copy_release", False)] * CPU_L
        asked.clear()
        b = early.step(x)
        assert asked == [("early_weights", True), ("copy_release", True)] * CPU_L
        assert misses(early) > before, "every step must miss (and evict)"
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        sa, sb = state(plain), state(early)
        for name in sa:
            assert torch.equal(sa[name], sb[name]), name


def profile_step(model: SyntheticModel, x: torch.Tensor, path) -> list:
    """One eager step under the profiler with the shared expert inside record_function ranges."""
    for layer in model.layers:
        inner = layer.shared_expert

        def wrapped(h, inner=inner):
            with torch.profiler.record_function("test.shared_expert"):
                return inner(h)
        layer.shared_expert = wrapped
    model.step(x)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        model.step(x)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return load_trace(path)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["on", "off"])
def test_copy_on_compute_stream_shared_on_side_stream(gpu_weights, overlap, tmp_path):
    model = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=overlap)
    x = torch.randn(2, GPU_CFG.hidden, device="cuda").to(BF16)
    events = profile_step(model, x, tmp_path / "trace.json")
    ks = kernels(events)
    copies, ensures = named(ks, "_miss_copy_kernel"), named(ks, "ensure_kernel")
    routers, routed = named(ks, "_router_kernel"), named(ks, "_gate_up_kernel") + named(ks, "_down_kernel")
    hits = named(ks, "_gate_up_hits")  # overlap on (early hits: the pool cannot hold every expert)
    shared = kernels_in_range(events, "test.shared_expert")
    assert len(copies) == len(ensures) == len(routers) == GPU_L and len(routed) == 2 * GPU_L
    assert sorted(k.name for k in shared) == sorted(["_shared_gate_up", "_shared_down"] * GPU_L)
    assert len(hits) == (GPU_L if overlap else 0)
    # router 1, ensure 1, copy 1, routed 2, shared 2 (+ the early hits' gate_up with overlap on)
    assert len(ks) == (8 if overlap else 7) * GPU_L, sorted(k.name for k in ks)
    compute = {k.stream for k in copies + ensures + routers + routed}
    assert len(compute) == 1, "router path, ensure, copy and routed GEMM share the compute stream"
    side = {k.stream for k in shared + hits}
    if overlap:
        assert side.isdisjoint(compute) and len(side) == 1
    else:
        assert side == compute
    model.close()


@pytest.mark.gpu
def test_side_stream_survives_rebuild(gpu_weights):
    on = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=True)
    off = SyntheticModel(gpu_weights, GPU_S, "cuda", copy_overlap=False)
    gen = torch.Generator("cuda").manual_seed(5)
    xs = [torch.randn(2, GPU_CFG.hidden, generator=gen, device="cuda").to(BF16) for _ in range(6)]
    Runner(on, True, 2, xs[:2])
    side = on.slots.side
    for model in (on, off):
        model.rebuild(GPU_S + 8)
    assert on.slots.side is side and not side.closed
    assert all(layer.side is side for layer in on.layers)
    close_to_reference(on, xs[2])
    close_to_reference(off, xs[2])
    run_on, run_off = Runner(on, True, 2, xs[3:4]), Runner(off, True, 2, xs[3:4])
    for x in xs[4:]:
        assert torch.equal(run_on(x).view(torch.int16), run_off(x).view(torch.int16))
    on.close()


@pytest.mark.gpu
def test_layer_matches_reference_gpu(gpu_weights):
    model = SyntheticModel(gpu_weights, 8 * GPU_CFG.top_k, "cuda", copy_overlap=True)  # 8 tokens fit
    gen = torch.Generator("cuda").manual_seed(9)
    for tokens in (1, 2, 8):
        close_to_reference(model, torch.randn(tokens, GPU_CFG.hidden, generator=gen, device="cuda").to(BF16))
    model.close()
