"""Seeded synthetic routing traces, shaped like real MoE decode routing.

Model (one latent router per layer and batch row, sampled in decode order):

    base log-popularity  b[l, e] = -zipf * log(rank_l(e)), rank_l a random permutation
    request topic        p[r, l] = softmax(b[l] + topic * g[r, l]),  g ~ N(0, 1) per request r
    working set          m[l] = reuse_decay * m[l] + onehot(experts of the previous token),
                         reset to 0 at a request boundary; w = m / sum(m)
    routing mixture      q[t, l] = (1 - reuse) * p[r(t), l] + reuse * w[l]   (q = p if m = 0)
    router logits        z[t, l, e] = logit_scale * (log q[t, l, e] + G),  G ~ Gumbel(0, 1)
    routed experts       the top_k of z; weights = softmax of their logits (float32, sums to 1)

Taking the top-k of log q + Gumbel noise is sampling k experts without replacement in
proportion to q (Plackett-Luce): with top_k = 1 and topic = reuse = 0 an expert's popularity is
rank^-zipf, and a token repeats one of the previous token's experts with probability
about `reuse` on top of what popularity alone gives. It is computed as an exponential
race: the top-T logits are the T smallest keys Exp(1) / q, one pass over the experts.

Data flow: SyntheticConfig -> numpy PCG64 (seed) draws permutations, request lengths,
topic vectors and, chunk by chunk, the Exp(1) noise -> the compiled kernel `_route`
selects the top-T per row and updates the working sets -> Trace (experts [N, L, B, k],
weights, req_index, optional top-T logits with T = min(2 * top_k, num_experts)).

Batch rows are independent sequences (own requests, topics, working sets) sharing the
layers' base popularity. `calibration_table` compares a synthetic trace's LRU and Belady
hit-rate curves with a real trace's; docs/synthetic.md holds the fitted parameters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
from numba import njit

from sim.trace import Trace, TraceMeta

_CHUNK_VALUES = 1 << 21  # Exp(1) draws per chunk: bounds the kernel's scratch memory


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape and routing statistics of a synthetic trace. Every field is checked on
    construction; a bad value raises ValueError naming the field."""

    num_layers: int
    num_experts: int
    top_k: int
    num_tokens: int
    batch: int = 1
    zipf: float = 0.35  # popularity skew: p ~ rank^-zipf within a layer
    reuse: float = 0.12  # weight of the working set in the routing mixture, [0, 1)
    reuse_decay: float = 0.15  # working-set memory per token, [0, 1): 0 = previous token only
    topic: float = 0.3  # std of the per-request log-popularity offset
    request_tokens: int = 256  # mean request length in tokens (uniform in [0.5, 1.5] x mean)
    logit_scale: float = 1.0  # router temperature: scales logits and so the weights
    seed: int = 0
    expert_bytes: int | None = None
    model: str = "synthetic"
    with_logits: bool = False
    hidden_size: int | None = None  # one routed expert's H and I (meta keys of the same names):
    moe_intermediate_size: int | None = None  # both or neither; they price expert formats

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "num_tokens", "batch",
                     "request_tokens"):
            self._set(name, _check_int(name, getattr(self, name), 1))
        self._set("seed", _check_int("seed", self.seed, 0))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k} exceeds num_experts {self.num_experts}")
        self._set("zipf", _check_float("zipf", self.zipf, 0.0, 16.0))
        self._set("reuse", _check_float("reuse", self.reuse, 0.0, 1.0, hi_open=True))
        self._set("reuse_decay", _check_float("reuse_decay", self.reuse_decay, 0.0, 1.0,
                                              hi_open=True))
        self._set("topic", _check_float("topic", self.topic, 0.0, 16.0))
        self._set("logit_scale", _check_float("logit_scale", self.logit_scale, 0.0, 1e6,
                                              lo_open=True))
        if self.expert_bytes is not None:
            self._set("expert_bytes", _check_int("expert_bytes", self.expert_bytes, 1))
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) is not None:
                self._set(name, _check_int(name, getattr(self, name), 1))
        if (self.hidden_size is None) != (self.moe_intermediate_size is None):
            raise ValueError("hidden_size, moe_intermediate_size: give both or neither")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: must be a non-empty string, got {self.model!r}")
        if not isinstance(self.with_logits, bool):
            raise ValueError(f"with_logits: must be a bool, got {self.with_logits!r}")

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # plain int / float, so the config is JSON-ready

    @property
    def logit_width(self) -> int:
        """T, the number of top router logits emitted per row."""
        return min(2 * self.top_k, self.num_experts)


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name}: must be an integer >= {lo}, got {value!r}")
    return int(value)


def _check_float(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo)
    ok = ok and (value < hi if hi_open else value <= hi)
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}: must be a finite number in {span}, got {value!r}")
    return float(value)


def _bf16_expert(hidden: int, inter: int) -> dict[str, int]:
    """The config fields of a bf16 expert of this shape: gate, up and down, 2 bytes a weight."""
    return dict(expert_bytes=3 * hidden * inter * 2, hidden_size=hidden, moe_intermediate_size=inter)


def zipf_for_spread(spread: float, num_experts: int) -> float:
    """The zipf exponent whose log-popularity -zipf * log(rank), ranks 1..E, has standard
    deviation `spread`: a skew measure that carries across expert counts."""
    sd = float(np.log(np.arange(1, num_experts + 1)).std())
    return round(spread / sd, 4) if sd > 0 else 0.0


SPREAD = 0.32  # std of the static per-layer log-popularity, fitted on both real traces
ROUTING = dict(reuse=0.12, reuse_decay=0.15, topic=0.3)  # fitted on both real traces


def _routed(L: int, E: int, k: int, N: int, **fields) -> SyntheticConfig:
    """A config with the calibrated routing statistics for a model of this shape."""
    return SyntheticConfig(L, E, k, N, zipf=zipf_for_spread(SPREAD, E), **ROUTING, **fields)


PRESETS: dict[str, SyntheticConfig] = {
    "qwen3-next": _routed(48, 512, 10, 2000, **_bf16_expert(2048, 512),
                          logit_scale=0.5, model="synthetic:qwen3-next"),
    "qwen3-30b-a3b": _routed(48, 128, 8, 2000, **_bf16_expert(2048, 768),
                             logit_scale=0.5, model="synthetic:qwen3-30b-a3b"),
    "gpt-oss-20b": _routed(24, 32, 4, 2000, **_bf16_expert(2880, 2880),
                           logit_scale=0.5, model="synthetic:gpt-oss-20b"),
    "gpt-oss-120b": _routed(36, 128, 4, 2000, **_bf16_expert(2880, 2880),
                            logit_scale=0.5, model="synthetic:gpt-oss-120b"),
    "glm-4.5-air": _routed(45, 128, 8, 2000, **_bf16_expert(4096, 1408),
                           logit_scale=0.5, model="synthetic:glm-4.5-air"),
    "glm-4.5": _routed(89, 160, 8, 2000, **_bf16_expert(5120, 1536),
                       logit_scale=0.5, model="synthetic:glm-4.5"),
    "mixtral": _routed(32, 8, 2, 2000, **_bf16_expert(4096, 14336),
                       request_tokens=122, logit_scale=0.9, model="synthetic:mixtral"),
    "olmoe-1b-7b": _routed(16, 64, 8, 2000, **_bf16_expert(2048, 1024),
                           logit_scale=0.5, model="synthetic:olmoe-1b-7b"),
    "mixtral-like": _routed(32, 8, 2, 244, request_tokens=122, logit_scale=0.9,
                            model="synthetic:mixtral-like"),
    "flame-like": _routed(8, 64, 6, 1024, request_tokens=256, logit_scale=0.5,
                          model="synthetic:flame-like"),
}


def preset(name: str, **overrides) -> SyntheticConfig:
    """A preset's config with fields replaced (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **overrides)


@njit(cache=True)
def _new_request(gauss, base, topic, pop, mem, msum):
    """Start a request on one batch row: fresh topic popularity, empty working sets.
    gauss [L, E], base [L, E]; pop / mem [L, E] and msum [L] of that row, in place."""
    L, E = base.shape
    for l in range(L):
        hi = -np.inf
        for e in range(E):
            v = base[l, e] + topic * gauss[l, e]
            pop[l, e] = v
            hi = max(hi, v)
        s = 0.0
        for e in range(E):
            pop[l, e] = np.exp(pop[l, e] - hi)
            s += pop[l, e]
        for e in range(E):
            pop[l, e] /= s
            mem[l, e] = 0.0
        msum[l] = 0.0


@njit(cache=True, error_model="numpy")
def _top(expo, pop, mem, msum, reuse, keys, sel):
    """Write the T smallest race keys Exp(1) / q of one row, ascending, into keys and
    their experts into sel; q mixes popularity and the working set."""
    T = keys.shape[0]
    a = 1.0 - reuse if msum > 0.0 else 1.0
    c = reuse / msum if msum > 0.0 else 0.0
    n = 0
    for e in range(pop.shape[0]):
        key = expo[e] / (a * pop[e] + c * mem[e])
        if n == T and key >= keys[T - 1]:
            continue
        j = n if n < T else T - 1
        while j > 0 and keys[j - 1] > key:
            keys[j] = keys[j - 1]
            sel[j] = sel[j - 1]
            j -= 1
        keys[j] = key
        sel[j] = e
        n = min(n + 1, T)


@njit(cache=True)
def _remember(mem, msum, sel, k, decay):
    """Decay one row's working set and add the k experts just chosen."""
    s = 0.0
    for e in range(mem.shape[0]):
        v = mem[e] * decay
        mem[e] = v if v > 1e-9 else 0.0
        s += mem[e]
    for j in range(k):
        mem[sel[j]] += 1.0
    msum[0] = s + k


@njit(cache=True, error_model="numpy")
def _route(expo, start, gauss, base, topic, reuse, decay, k, pop, mem, msum, ids, logit):
    """Route a chunk of tokens. expo [n, L, B, E] Exp(1) noise; start [n, B] index into
    gauss [R, L, E] where a request starts (else -1); state pop / mem [L, B, E], msum
    [L, B]; outputs ids int32 / logit float64 [n, L, B, T] (log q + Gumbel, descending)."""
    n, L, B, E = expo.shape
    T = ids.shape[3]
    keys = np.empty(T)
    sel = np.empty(T, dtype=np.int64)
    for t in range(n):
        for b in range(B):
            if start[t, b] >= 0:
                _new_request(gauss[start[t, b]], base, topic, pop[:, b], mem[:, b], msum[:, b])
        for l in range(L):
            for b in range(B):
                _top(expo[t, l, b], pop[l, b], mem[l, b], msum[l, b], reuse, keys, sel)
                ms = msum[l, b]
                for j in range(T):
                    e = sel[j]
                    q = pop[l, b, e] if ms <= 0.0 else (
                        (1.0 - reuse) * pop[l, b, e] + reuse * mem[l, b, e] / ms)
                    ids[t, l, b, j] = e
                    logit[t, l, b, j] = np.log(q) - np.log(max(expo[t, l, b, e], 1e-300))
                _remember(mem[l, b], msum[l, b:b + 1], sel, k, decay)


def _base_logpop(cfg: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    """[L, E] float64: -zipf * log(rank), ranks 1..E in a random order per layer."""
    ranks = np.argsort(rng.random((cfg.num_layers, cfg.num_experts)), axis=1) + 1
    return -cfg.zipf * np.log(ranks.astype(np.float64))


def _requests(cfg: SyntheticConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Request boundaries of every batch row: (req_index int32 [N, B], request ids
    numbered row by row; starts bool [N, B], True on each request's first token)."""
    N, B, m = cfg.num_tokens, cfg.batch, cfg.request_tokens
    lo, hi = max(1, round(0.5 * m)), max(1, round(1.5 * m))
    req = np.empty((N, B), dtype=np.int32)
    starts = np.zeros((N, B), dtype=bool)
    first = 0
    for b in range(B):
        lengths = rng.integers(lo, hi + 1, size=N // lo + 1)
        begin = np.concatenate([[0], np.cumsum(lengths)])
        begin = begin[begin < N]
        starts[begin, b] = True
        req[:, b] = first + np.cumsum(starts[:, b]) - 1
        first += len(begin)
    return req, starts


def _route_all(cfg: SyntheticConfig, rng: np.random.Generator, base: np.ndarray,
               starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel over the tokens in chunks of bounded noise memory."""
    N, L, B, E, T = cfg.num_tokens, cfg.num_layers, cfg.batch, cfg.num_experts, cfg.logit_width
    if not cfg.with_logits:
        T = cfg.top_k
    ids = np.empty((N, L, B, T), dtype=np.int32)
    logit = np.empty((N, L, B, T), dtype=np.float64)
    pop = np.empty((L, B, E))
    mem = np.zeros((L, B, E))
    msum = np.zeros((L, B))
    step = max(1, _CHUNK_VALUES // (L * B * E))
    for t0 in range(0, N, step):
        t1 = min(N, t0 + step)
        expo = rng.standard_exponential((t1 - t0, L, B, E))
        new = starts[t0:t1]
        start = np.where(new, np.cumsum(new).reshape(new.shape) - 1, -1)
        gauss = rng.standard_normal((int(new.sum()), L, E))
        _route(expo, start, gauss, base, float(cfg.topic), float(cfg.reuse),
               float(cfg.reuse_decay), cfg.top_k, pop, mem, msum, ids[t0:t1], logit[t0:t1])
    return ids, logit * cfg.logit_scale


def generate(cfg: SyntheticConfig) -> Trace:
    """A deterministic synthetic decode trace for `cfg` (same config, same trace)."""
    rng = np.random.default_rng(cfg.seed)
    req, starts = _requests(cfg, rng)
    base = _base_logpop(cfg, rng)
    ids, logit = _route_all(cfg, rng, base, starts)
    k = cfg.top_k
    chosen = logit[..., :k]
    w = np.exp(chosen - chosen[..., :1])
    weights = (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)
    shape = ({} if cfg.hidden_size is None else
             {"hidden_size": cfg.hidden_size, "moe_intermediate_size": cfg.moe_intermediate_size})
    meta = TraceMeta(model=cfg.model, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                     top_k=k, expert_bytes=cfg.expert_bytes, phase="decode",
                     source="synthetic:" + json.dumps(asdict(cfg), sort_keys=True),
                     license="CC0-1.0", extra=shape)
    lidx = lval = None
    if cfg.with_logits:
        lidx, lval = ids, logit.astype(np.float32)
    trace = Trace(experts=np.ascontiguousarray(ids[..., :k]), meta=meta, weights=weights,
                  req_index=req, logit_idx=lidx, logit_val=lval)
    trace.validate()
    return trace


CURVE_POLICIES = ("lru", "belady")


def calibration_slots(trace: Trace, extra: Sequence[int] = ()) -> list[int]:
    """Slot counts at 25, 50 and 75 % of all L * E experts, plus `extra`, ascending."""
    keys = trace.num_layers * trace.num_experts
    return sorted({round(f * keys) for f in (0.25, 0.5, 0.75)} | {int(s) for s in extra})


def hit_curves(trace: Trace, slots: Sequence[int]) -> dict[str, list[float]]:
    """Cold-start hit rate of each CURVE_POLICIES policy at each slot count."""
    from sim.replay import replay  # the cache engine: needed to compare, not to generate

    return {p: [replay(trace, p, int(s)).hit_rate for s in slots] for p in CURVE_POLICIES}


def calibration_table(real: Trace, cfg: SyntheticConfig, slots: Sequence[int] | None = None,
                      seeds: Sequence[int] | None = None) -> list[dict[str, float]]:
    """Real against synthetic hit rates, one row per slot count (default calibration_slots).

    The synthetic curve is the mean over traces generated from `cfg` with each of `seeds`
    (default: cfg.seed only). Rows:
    {"slots", "<policy>_real", "<policy>_synth"} for policy in CURVE_POLICIES.
    """
    slots = calibration_slots(real) if slots is None else [int(s) for s in slots]
    want = hit_curves(real, slots)
    seeds = [cfg.seed] if seeds is None else seeds
    runs = [hit_curves(generate(replace(cfg, seed=int(s))), slots) for s in seeds]
    rows = []
    for i, s in enumerate(slots):
        row: dict[str, float] = {"slots": s}
        for p in CURVE_POLICIES:
            row[f"{p}_real"] = want[p][i]
            row[f"{p}_synth"] = float(np.mean([r[p][i] for r in runs]))
        rows.append(row)
    return rows


def max_gap(rows: Sequence[dict[str, float]]) -> float:
    """The largest |real - synthetic| hit-rate difference of a calibration table."""
    return max(abs(r[f"{p}_real"] - r[f"{p}_synth"]) for r in rows for p in CURVE_POLICIES)


@njit(cache=True)
def _pick(score, tie, k, out):
    """The k experts of largest (score, tie), lower id first on equal pairs, into out."""
    E = score.shape[0]
    taken = np.zeros(E, dtype=np.bool_)
    for j in range(k):
        best = -1
        for e in range(E):
            if not taken[e] and (best < 0 or score[e] > score[best]
                                 or (score[e] == score[best] and tie[e] > tie[best])):
                best = e
        taken[best] = True
        out[j] = best


@njit(cache=True)
def _predictability(ex, E, warm):
    """(transition hits, frequency hits, predictions) over ex int32 [N, L, B, k] (-1 = none)."""
    N, L, B, k = ex.shape
    C = np.zeros((L, E, E), dtype=np.int64)  # [l, a, b]: a at token t - 1, b at token t, same row
    F = np.zeros((L, E), dtype=np.int64)
    s = np.zeros(E, dtype=np.int64)
    pred = np.empty(k, dtype=np.int64)
    hit_t = hit_f = count = 0
    for t in range(1, N):
        for l in range(L):
            for b in range(B):
                cur = np.zeros(E, dtype=np.bool_)
                m = 0
                for j in range(k):
                    if ex[t, l, b, j] >= 0 and not cur[ex[t, l, b, j]]:
                        cur[ex[t, l, b, j]] = True
                        m += 1
                s[:] = 0
                for j in range(k):
                    a = ex[t - 1, l, b, j]
                    if a >= 0:
                        s += C[l, a]
                if t >= warm and m > 0 and s.sum() > 0:
                    _pick(s, F[l], m, pred)
                    for j in range(m):
                        hit_t += cur[pred[j]]
                    _pick(F[l], np.zeros(E, dtype=np.int64), m, pred)
                    for j in range(m):
                        hit_f += cur[pred[j]]
                    count += m
                for j in range(k):
                    a = ex[t - 1, l, b, j]
                    if a >= 0:
                        for e in range(E):
                            if cur[e]:
                                C[l, a, e] += 1
                for e in range(E):
                    if cur[e]:
                        F[l, e] += 1
    return hit_t, hit_f, count


def predictability(trace: Trace, warm: int = 20) -> dict[str, float]:
    """How well a layer's routing at the previous token predicts it, beside popularity alone, learned
    online (the statistic `markov` lives on). From token `warm` on, each layer's and row's experts at
    token t are predicted as the m with the most counted transitions from the experts it routed to at
    t - 1 (m = how many it routes to at t), and as the m most used so far; `transition` and
    `frequency` are the shares predicted right, `lift` their difference. Real decode routing has a lift
    well above 0 where the synthetic model (popularity, topic and working set, no transitions) has
    about none (benchmarks/calibrate_synthetic.py)."""
    ht, hf, n = _predictability(np.ascontiguousarray(trace.experts), trace.num_experts, warm)
    if n == 0:
        return {"transition": 0.0, "frequency": 0.0, "lift": 0.0}
    return {"transition": ht / n, "frequency": hf / n, "lift": (ht - hf) / n}
