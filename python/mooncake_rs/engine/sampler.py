"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed.

A request with a ``seed`` draws the noise for its ``n``-th generated token from a
generator seeded with ``(seed, n)``: the same request gives the same tokens whatever it
is batched with, after a preemption (recompute), and when its first token is sampled on a
prefill instance and the rest on a decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import InvalidArgument

__all__ = ["SamplingParams", "Sampler", "filtered_probs"]

_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (top-k/top-p then do nothing)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise InvalidArgument(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidArgument(f"seed must be None or an int >= 0, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise sampling distribution after temperature, top-k and top-p.

    ``logits [S, V]`` float32; per-row ``temperature`` (> 0), ``top_k`` (V for off),
    ``top_p``. Returns ``(probs, order)``: ``probs[s, j]`` is the probability of token
    ``order[s, j]`` (tokens sorted by decreasing logit; filtered ones have probability 0).
    """
    v = logits.shape[-1]
    sl, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    rank = torch.arange(v, device=logits.device)[None, :]
    sl = sl.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sl.softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


class Sampler:
    """Picks one token per row of a logits batch."""

    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator()
        self._gen.manual_seed(int(seed))
        self._row_gen = torch.Generator()

    def _noise(self, v: int, seed: int | None, index: int) -> torch.Tensor:
        if seed is None:
            return torch.empty(v).exponential_(generator=self._gen)
        self._row_gen.manual_seed((seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK63)
        return torch.empty(v).exponential_(generator=self._row_gen)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               indices: Sequence[int]) -> list[int]:
        """``logits [S, V]``; ``params[s]`` and ``indices[s]`` (how many tokens the request
        has generated so far) for each row. Returns one token id per row."""
        out = logits.argmax(dim=-1).tolist()
        rows = [s for s, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        v = logits.shape[-1]
        dev = logits.device
        sub = logits[rows] if len(rows) < len(params) else logits
        temp = torch.tensor([params[s].temperature for s in rows], device=dev)
        top_k = torch.tensor([params[s].top_k if params[s].top_k > 0 else v for s in rows], device=dev)
        top_p = torch.tensor([params[s].top_p for s in rows], device=dev)
        probs, order = filtered_probs(sub, temp, top_k, top_p)
        noise = torch.stack([self._noise(v, params[s].seed, indices[s]) for s in rows]).to(dev)
        # exponential race: argmax p / E with E ~ Exp(1) draws from p
        pick = (probs / noise).argmax(dim=-1, keepdim=True)
        chosen = order.gather(1, pick).squeeze(1).tolist()
        for s, tok in zip(rows, chosen):
            out[s] = tok
        return out
