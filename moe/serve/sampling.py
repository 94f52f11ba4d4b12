"""Next-token choice of a decode step: logits [B, V] -> one token id per row, greedy or sampled.

    logits float32 [B, V] (one row per active sequence, on the model's device)
      ─argmax over all rows─► the greedy rows' tokens
      rows with temperature > 0, on the same device: softmax(logits[b] / temperature)
          ─► keep the smallest set of most probable tokens whose mass reaches top_p
          ─► torch.multinomial with the request's own torch.Generator on that device
      ─► one host copy of the B ids
    rows asking for logprobs: log_softmax(logits[b]) (the model's distribution, before temperature and
        top-p, as OpenAI and vLLM report it) ─► the chosen token's logprob and the top-n alternatives
The generator is per request, seeded from the request's `seed` (or from the OS when absent), so a
seeded request draws the same tokens whatever else shares its decode steps (on one device: a CUDA
generator's stream differs from the CPU's).
Legend: B = active sequences, V = vocab.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

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
    """The token chooser of one request: greedy, or temperature / top-p with a seeded generator on the
    device of the logits it is given (one per device, made on first use from the request's seed: a
    seeded request repeats on one device; a CUDA generator's stream is not the CPU's)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = None
        self._generators: dict[torch.device, torch.Generator] = {}
        if not params.greedy:
            self.seed = params.seed if params.seed is not None else secrets.randbits(63)

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's generator on `device`, seeded from its seed on first use."""
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] on any device -> int64 [1] on that device: a token drawn from the top-p nucleus at
        the temperature, with no host copy."""
        p = self.params
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)  # [V]
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more probable tokens
            keep = before < p.top_p  # always keeps the most probable token
            probs = torch.zeros_like(probs).scatter_(0, order, torch.where(keep, sorted_probs, 0.0))
        return torch.multinomial(probs, 1, generator=self.generator(logits.device))

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> a token id (draw, then one host copy)."""
        return int(self.draw(logits))


def choose(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row: logits float32 [B, V] (any device), samplers [B] -> B token ids.

    Everything runs on the logits' device: one argmax over [B, V], per sampled row a softmax (and a
    sort of V when top_p < 1) and a draw, then one host copy of the B ids.
    """
    tokens = logits.argmax(dim=-1)  # [B], a new tensor: written in place below
    for row, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            tokens[row] = sampler.draw(logits[row])[0]
    return tokens.tolist()


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
