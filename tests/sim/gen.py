"""Random valid traces for the trace and importer tests."""

from __future__ import annotations

import numpy as np

from sim.trace import Trace, TraceMeta


def random_trace(seed: int, n: int = 6, layers: int = 3, batch: int = 1, k: int = 2,
                 num_experts: int = 8, *, weights: bool = True, req: bool = True,
                 logits: int = 0, extra: dict | None = None) -> Trace:
    """Distinct ids per row with some -1 padding, nonzero weights, req_index numbering
    request runs 0, 1, 2, ... in order, and optional top-`logits` router logits."""
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((n, layers, batch, num_experts)), axis=-1)
    experts = order[..., :k].astype(np.int32)
    experts[rng.random(experts.shape) < 0.1] = -1
    meta = TraceMeta(model=f"test-moe-{seed}", num_layers=layers, num_experts=num_experts,
                     top_k=k, expert_bytes=int(rng.integers(1, 1 << 30)), phase="decode",
                     source="generated", license="test", extra=extra or {"seed": seed})
    w = (rng.random(experts.shape) + 0.01).astype(np.float32) if weights else None
    r = None
    if req:
        r = np.cumsum(rng.random((n, batch)) < 0.4, axis=0)
        r = (r - r[0]).astype(np.int32)
    li = lv = None
    if logits:
        li = rng.integers(-1, num_experts, (n, layers, batch, logits)).astype(np.int32)
        lv = rng.standard_normal(li.shape).astype(np.float32)
    return Trace(experts=experts, meta=meta, weights=w, req_index=r, logit_idx=li, logit_val=lv)
