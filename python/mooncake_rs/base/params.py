"""Sampling parameters of a request: what a client builds, validated on construction.

Torch-free on purpose: a client of a multi-process cluster builds these, and must not
import torch for it (the sampler that uses them, :mod:`.sampler`, does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgument

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (top-k/top-p then do nothing).

    A request with a ``seed`` draws the noise of its ``n``-th generated token from
    ``(seed, n)`` alone (see :class:`.sampler.Sampler`).
    """

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
