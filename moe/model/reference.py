"""Torch reference of one MoE block, from the full expert tensors (any device, float32 accumulate).

    hidden [T, H] ──route──► weights [T, k] float32, ids [T, k] int32
           │                        │
           ├──► routed: Σ_j weights[t, j] * expert_mlp(hidden[t], experts[ids[t, j]])   (float32)
           ├──► shared: sigmoid(hidden @ gate_wᵀ) * expert_mlp(hidden, shared)           (float32)
           └──► out [T, H] = routed + shared, cast once to hidden's dtype

Legend: T = tokens, H = hidden, E = routed experts, k = top_k, I = routed expert width,
Is = shared expert width. A gate_up weight stacks gate_proj over up_proj: rows [0, I) are gate, rows
[I, 2I) are up (the vLLM w13 layout). down is [H, I].

Math, as transformers' Qwen2MoeSparseMoeBlock: logits = hidden @ router_wᵀ; probs = softmax(logits) in
float32; (weights, ids) = topk(probs, k) sorted by weight descending; if norm_topk_prob, weights /=
weights.sum(-1); expert MLP = down(silu(gate(x)) * up(x)); out = Σ routed + sigmoid(shared_gate(x)) *
shared(x). Precision differs on purpose: every product here is in float32 and rounded once at the end,
whereas transformers rounds after each linear (and the routing weights) to the model dtype. Mixtral
(softmax over the top-k logits) equals this with norm_topk_prob=True and no shared expert. gpt-oss
(GptOssMLP) too, with a router bias added to the logits, each expert's biases added after gate_up and
after down, and its clamped SwiGLU as the activation (gated_activation; its checkpoints interleave gate
and up columns, which the loader splits into this layout).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moe.model.config import MoEConfig

# (gate_up [2Is, H], down [H, Is], gate_w [1, H]); gate_up and down may instead be one-slot SlotMatrix
# (moe.model.slot_matrix) in a quantized checkpoint's format, gate_up a stack of 2 [1, 2Is, H]
SharedWeights = tuple[Any, Any, torch.Tensor]


def route(
    hidden: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool,
    router_b: torch.Tensor | None = None, *, scoring: str = "softmax", score_bias: torch.Tensor | None = None,
    n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: hidden [T, H], router_w [E, H] (and gpt-oss's bias router_b [E]) -> (weights [T, k]
    float32, ids [T, k] int32).

    "softmax" scoring: softmax in float32 over all E logits, top-k ordered by weight descending,
    optionally renormalised to sum to 1 per row (equal to a softmax over the top-k logits, gpt-oss's
    and Mixtral's router). "sigmoid" (GLM-4.5): each expert's score is sigmoid(logit); the experts are
    chosen by score + score_bias [E] (descending), within the topk_group of n_group equal groups whose
    two best biased scores sum highest; the weights are the chosen experts' unbiased scores,
    renormalised (plus 1e-20) when norm_topk_prob. Either way the weights are then multiplied by
    `scaling` (routed_scaling_factor). Cost O(T * E * H). Raises ValueError naming `top_k`,
    `router_w`, `router_b` or `score_bias` on bad shapes.
    """
    if router_w.dim() != 2 or router_w.shape[1] != hidden.shape[-1]:
        raise ValueError(f"route: router_w must be [E, {hidden.shape[-1]}], got {tuple(router_w.shape)}")
    experts = router_w.shape[0]
    if not 1 <= top_k <= experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, E={experts}]")
    for name, b in (("router_b", router_b), ("score_bias", score_bias)):
        if b is not None and tuple(b.shape) != (experts,):
            raise ValueError(f"route: {name} must be [E={experts}], got {tuple(b.shape)}")
    logits = hidden.float() @ router_w.float().T  # [T, E]
    if router_b is not None:
        logits = logits + router_b.float()
    if scoring == "sigmoid":
        weights, ids = _route_sigmoid(logits, top_k, norm_topk_prob, score_bias, n_group, topk_group)
    else:
        probs = torch.softmax(logits, dim=-1)  # [T, E] float32
        weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)  # [T, k]
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids.to(torch.int32)


def _route_sigmoid(logits: torch.Tensor, top_k: int, norm: bool, score_bias: torch.Tensor | None,
                   n_group: int, topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """route's "sigmoid" choice (GLM-4.5 as transformers computes it): (weights, ids [T, k] int64)."""
    scores = torch.sigmoid(logits)  # [T, E]
    choice = scores if score_bias is None else scores + score_bias.float()
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        worth = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, worth.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(tokens, experts), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices  # [T, k] by biased score, descending
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def route_block(hidden: torch.Tensor, router_w: torch.Tensor, cfg: MoEConfig, router_b: torch.Tensor | None = None,
                score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route with the routing fields of `cfg` (scoring, groups, scaling): (weights [T, k] float32, ids
    [T, k] int32). Raises ValueError naming router_b / score_bias when given against cfg (or missing)."""
    if (router_b is not None) != cfg.router_bias or (score_bias is not None) != cfg.score_bias:
        raise ValueError(f"route_block: give router_b exactly when cfg.router_bias (={cfg.router_bias}) and "
                         f"score_bias exactly when cfg.score_bias (={cfg.score_bias})")
    return route(hidden, router_w, cfg.top_k, cfg.norm_topk_prob, router_b, scoring=cfg.scoring,
                 score_bias=score_bias, n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling)


def gated_activation(gate_up: torch.Tensor, cfg: MoEConfig | None = None) -> torch.Tensor:
    """gate_up [..., 2I] float32 (gate in the first I, up in the last I) -> act [..., I] float32:
    silu(gate) * up, or for cfg.activation "swiglu_clamped" (gpt-oss) (clamp(up, -l, l) + 1) *
    g * sigmoid(alpha * g) with g = min(gate, l), l = swiglu_limit, alpha = swiglu_alpha."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if cfg is None or cfg.activation == "silu":
        return F.silu(gate) * up
    limit = cfg.swiglu_limit
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, cfg: MoEConfig | None = None,
               b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Gated MLP: x [T, H], w_gate_up [2I, H], w_down [H, I] (and gpt-oss's biases b_gate_up [2I],
    b_down [H]) -> [T, H] float32.

    down(act(gate_up(x) + b_gate_up)) + b_down in float32, act = gated_activation (cfg's; SiLU without
    cfg). Cost O(T * 3 * I * H). Raises ValueError naming the weight whose shape does not match.
    """
    hidden = x.shape[-1]
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2 or w_gate_up.shape[1] != hidden:
        raise ValueError(f"expert_mlp: w_gate_up must be [2I, {hidden}], got {tuple(w_gate_up.shape)}")
    inter = w_gate_up.shape[0] // 2
    if tuple(w_down.shape) != (hidden, inter):
        raise ValueError(f"expert_mlp: w_down must be [{hidden}, {inter}], got {tuple(w_down.shape)}")
    gate_up = x.float() @ w_gate_up.float().T  # [T, 2I]
    if b_gate_up is not None:
        gate_up = gate_up + b_gate_up.float()
    out = gated_activation(gate_up, cfg) @ w_down.float().T  # [T, H]
    return out if b_down is None else out + b_down.float()


def shared_expert(x: torch.Tensor, shared: SharedWeights) -> torch.Tensor:
    """Gated shared expert: x [T, H] -> sigmoid(x @ gate_wᵀ) * expert_mlp(x, gate_up, down), [T, H] float32
    (a quantized gate_up / down decoded with its format's torch reference first); gate_w None (GLM-4.5's
    shared experts): expert_mlp(x, gate_up, down) as it is."""
    gate_up, down, gate_w = shared
    gate_up, down = _dense(gate_up), _dense(down)
    if gate_w is None:
        return expert_mlp(x, gate_up, down)
    if tuple(gate_w.shape) != (1, x.shape[-1]):
        raise ValueError(f"shared: gate_w must be [1, {x.shape[-1]}], got {tuple(gate_w.shape)}")
    gate = torch.sigmoid(x.float() @ gate_w.float().T)  # [T, 1]
    return gate * expert_mlp(x, gate_up, down)


def _dense(w):
    """A shared expert's weight as a tensor: a one-slot SlotMatrix decoded to float32 [out, in]."""
    return w if isinstance(w, torch.Tensor) else w.dequantize([0])[0]


def moe_reference(
    hidden: torch.Tensor,
    router_w: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    cfg: MoEConfig,
    shared: SharedWeights | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    score_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MoE block: hidden [T, H] -> out [T, H] in hidden's dtype.

    router_w [E, H], experts_gate_up [E, 2I, H], experts_down [E, H, I], shared as `SharedWeights`
    (required exactly when cfg.shared_intermediate > 0), biases = (router [E], gate_up [E, 2I], down
    [E, H]) for a block with cfg.router_bias and cfg.expert_bias (gpt-oss), score_bias [E] for one with
    cfg.score_bias (GLM-4.5: route_block's routing). The experts' activation is
    cfg's (gated_activation). Cost O(T * k * 3 * I * H + T * E * H). Raises ValueError naming the
    argument whose shape or presence disagrees with `cfg`.
    """
    _check_shapes(hidden, router_w, experts_gate_up, experts_down, cfg, shared)
    if (biases is not None) != (cfg.router_bias or cfg.expert_bias):
        raise ValueError("moe_reference: give biases exactly when cfg.router_bias / cfg.expert_bias say so")
    b_router, b_gate_up, b_down = biases if biases is not None else (None, None, None)
    weights, ids = route_block(hidden, router_w, cfg, b_router, score_bias)  # [T, k] float32, int32
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    for expert in torch.unique(ids).tolist():
        rows, cols = torch.nonzero(ids == expert, as_tuple=True)  # tokens routed to `expert`
        y = expert_mlp(hidden[rows], experts_gate_up[expert], experts_down[expert], cfg,
                       None if b_gate_up is None else b_gate_up[expert],
                       None if b_down is None else b_down[expert])  # [n, H]
        out.index_add_(0, rows, y * weights[rows, cols, None])
    if shared is not None:
        out += shared_expert(hidden, shared)
    return out.to(hidden.dtype)


def _check_shapes(
    hidden: torch.Tensor,
    router_w: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    cfg: MoEConfig,
    shared: SharedWeights | None,
) -> None:
    """Raise ValueError naming the first argument whose shape disagrees with cfg."""
    h, e, i = cfg.hidden, cfg.num_experts, cfg.expert_intermediate
    expected = {
        "hidden": (hidden, (hidden.shape[0] if hidden.dim() == 2 else -1, h)),
        "router_w": (router_w, (e, h)),
        "experts_gate_up": (experts_gate_up, (e, 2 * i, h)),
        "experts_down": (experts_down, (e, h, i)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"moe_reference: {name} must be {list(shape)} (T, H, E, I from MoEConfig), "
                             f"got {list(tensor.shape)}")
    check_shared(cfg, shared, "moe_reference")


def check_shared(cfg: MoEConfig, shared: SharedWeights | None, who: str, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError (prefixed by `who`) unless `shared` is given exactly when cfg has a shared
    expert, with gate_up [2Is, H], down [H, Is], gate_w [1, H] (None exactly when not cfg.shared_gate)
    (and `dtype`, when given)."""
    if (shared is None) == cfg.has_shared_expert:
        raise ValueError(f"{who}: shared weights must be given exactly when MoEConfig.shared_intermediate > 0 "
                         f"(it is {cfg.shared_intermediate}, shared is {'absent' if shared is None else 'given'})")
    if shared is None:
        return
    if (shared[2] is None) == cfg.shared_gate:
        raise ValueError(f"{who}: the shared expert's gate_w must be given exactly when MoEConfig.shared_gate "
                         f"(={cfg.shared_gate}; GLM-4.5's shared experts have none)")
    h, s = cfg.hidden, cfg.shared_intermediate
    for name, w, shape in zip(("gate_up", "down", "gate_w"), shared, ((2 * s, h), (h, s), (1, h))):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor) and name != "gate_w" and hasattr(w, "fmt"):  # a one-slot SlotMatrix
            got = (w.num_slots, w.out_features, w.in_features, w.stack)
            if got != (1, *shape, 2 if name == "gate_up" else 1):
                raise ValueError(
                    f"{who}: shared {name} must be one slot of {list(shape)} (stack "
                    f"{2 if name == 'gate_up' else 1}), got {got[0]} slots of {list(got[1:3])} stack {got[3]}"
                )
            continue
        if tuple(w.shape) != shape or (dtype is not None and w.dtype != dtype):
            raise ValueError(f"{who}: shared {name} must be {list(shape)}{'' if dtype is None else f' {dtype}'}, "
                             f"got {list(w.shape)} {w.dtype}")
