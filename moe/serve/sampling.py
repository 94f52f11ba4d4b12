"""Next-token choice of a decode step: logits [B, V] -> one token id per row, greedy or sampled.

    logits float32 [B, V] (one row per active sequence, on the model's device)
      ─argmax over all rows (one launch, one host copy of B ids)─► the greedy rows' tokens
      rows with temperature > 0: logits[b] ─to host─► softmax(logits / temperature)
          ─► keep the smallest set of most probable tokens whose mass reaches top_p ─► renormalise
          ─► torch.multinomial with the request's own torch.Generator
    rows asking for logprobs: log_softmax(logits[b]) (the model's distribution, before temperature and
        top-p, as OpenAI and vLLM report it) ─► the chosen token's logprob and the top-n alternatives
The generator is per request, seeded from the request's `seed` (or from the OS when absent), so a
seeded request draws the same tokens whatever else shares its decode steps.
Legend: B = active sequences, V = vocab.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model and the most probable alternatives:
    top ((token id, logprob), ...) in descending order, as many as the request asked for."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of generation.

    max_tokens: new tokens at most (>= 1). temperature: 0 = greedy, else the softmax temperature
    (0 < t <= 2 as the OpenAI API allows). top_p: nucleus mass in (0, 1]. seed: the sampling
    generator's seed (None: drawn from the OS). stop: strings that end the text (not included).
    Raises ValueError naming the field on an invalid value.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """The token chooser of one request: greedy, or temperature / top-p with a seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits float32 [V] on the host -> a token id drawn from the top-p nucleus at the temperature."""
        p = self.params
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [V]
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more probable tokens
            keep = before < p.top_p  # always keeps the most probable token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


def choose(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row: logits float32 [B, V] (any device), samplers [B] -> B token ids.

    Cost: one argmax over [B, V] and a host copy of B ids; per sampled row, a host copy of its [V]
    logits and a sort of V when top_p < 1.
    """
    tokens = logits.argmax(dim=-1).tolist()  # [B]
    for row, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            tokens[row] = sampler.sample(logits[row].cpu())
    return tokens


def logprobs_of(samplers: Sequence[Sampler], logits: torch.Tensor, tokens: Sequence[int]) -> list[TokenLogprob | None]:
    """Per row, the TokenLogprob of its chosen token when its request asked for logprobs, else None.

    logits float32 [B, V], tokens [B]. Cost: nothing without a request for logprobs; else one
    log_softmax and one top-k over the [R, V] logits of the R rows that asked, and a host copy of them.
    """
    rows = [b for b, s in enumerate(samplers) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(samplers)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor([tokens[b] for b in rows], device=lp.device)[:, None])[:, 0].tolist()
    n = max(samplers[b].params.logprobs for b in rows)
    top_v, top_i = (lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for r, b in enumerate(rows):
        k = samplers[b].params.logprobs
        out[b] = TokenLogprob(tokens[b], chosen[r], tuple(zip(top_i[r][:k], top_v[r][:k])))
    return out
