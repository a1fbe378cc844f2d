"""The sampler: greedy, temperature, top-k, top-p, per-request seed.

A request with a ``seed`` draws the noise for its ``n``-th generated token from a
generator seeded with ``(seed, n)``: the same request gives the same tokens whatever it
is batched with, after a preemption (recompute), and when its first token is sampled on a
prefill instance and the rest on a decode instance. :class:`SamplingParams` lives in the
torch-free bottom layer (:mod:`mooncake_rs.base.params`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..base.params import SamplingParams

__all__ = ["Sampler", "filtered_probs"]

_MASK63 = (1 << 63) - 1

log = logging.getLogger("mooncake_rs.engine")


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
        # clamped to the vocabulary: a top_k past it keeps every token (and still fits int64)
        top_k = torch.tensor([min(params[s].top_k, v) if params[s].top_k > 0 else v for s in rows], device=dev)
        top_p = torch.tensor([params[s].top_p for s in rows], device=dev)
        probs, order = filtered_probs(sub, temp, top_k, top_p)
        noise = torch.stack([self._noise(v, params[s].seed, indices[s]) for s in rows]).to(dev)
        # exponential race: argmax p / E with E ~ Exp(1) draws from p
        pick = (probs / noise).argmax(dim=-1, keepdim=True)
        chosen = order.gather(1, pick).squeeze(1).tolist()
        for s, tok in zip(rows, chosen):
            out[s] = tok
        return out

    def sample_each(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                    indices: Sequence[int]) -> list[int | str]:
        """:meth:`sample`, except that where sampling a row raises, that row gets the
        error (a str) instead of a token: the batch first; if that raises, row by row, so
        one request's failure is that request's alone."""
        try:
            return list(self.sample(logits, params, indices))
        except Exception:  # noqa: BLE001 - find the row(s) at fault below
            log.exception("engine: sampling a batch of %d failed; sampling row by row", len(params))
        out: list[int | str] = []
        for i in range(len(params)):
            try:
                out.append(self.sample(logits[i:i + 1], params[i:i + 1], indices[i:i + 1])[0])
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                out.append(f"sampling failed: {type(e).__name__}: {e}")
        return out
