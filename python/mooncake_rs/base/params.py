"""Sampling parameters of a request: what a client builds, validated on construction.

Torch-free on purpose: a client of a multi-process cluster builds these, and must not
import torch for it (the sampler that uses them, :mod:`.sampler`, does).

Every field is bounded here, where it enters: a value that passes goes into a torch
tensor of int64 / float32 and onto the wire as msgpack without overflowing (a ``top_k``
of 2**63 once overflowed ``torch.tensor`` inside an instance's loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InvalidArgument

__all__ = ["SamplingParams", "MAX_TOKENS", "MAX_TOP_K", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MAX_SEED",
           "MAX_TOKEN_ID", "MAX_STOP_TOKEN_IDS"]

#: the largest ``max_tokens`` (any model's context is far below it)
MAX_TOKENS = (1 << 31) - 1
#: the largest ``top_k`` (the sampler clamps it to the vocabulary anyway)
MAX_TOP_K = (1 << 31) - 1
#: the temperature range of a sampled (non-greedy) request: below it logits / T leave
#: float32's range and the distribution becomes NaN; above it it is uniform anyway
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
#: seeds fit a signed 64-bit generator seed
MAX_SEED = (1 << 63) - 1
#: token ids (stop tokens) fit int32, as vocabularies do
MAX_TOKEN_ID = (1 << 31) - 1
MAX_STOP_TOKEN_IDS = 1024


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (top-k/top-p then do nothing).

    A request with a ``seed`` draws the noise of its ``n``-th generated token from
    ``(seed, n)`` alone (see :class:`.sampler.Sampler`).

    Bounds: ``max_tokens`` in 1..2**31-1; ``temperature`` 0 or in [1e-4, 1e4];
    ``top_k`` -1 (off) or 1..2**31-1; ``top_p`` in (0, 1]; ``seed`` None or 0..2**63-1;
    ``stop_token_ids`` at most 1024 ids in 0..2**31-1; ``ignore_eos`` a bool.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"max_tokens must be an int in 1..{MAX_TOKENS}, got {self.max_tokens!r}")
        t = self.temperature
        if not _is_real(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
            raise InvalidArgument(f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                                  f"{MAX_TEMPERATURE:g}], got {t!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K):
            raise InvalidArgument(f"top_k must be -1 (off) or an int in 1..{MAX_TOP_K}, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgument(f"seed must be None or an int in 0..{MAX_SEED}, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise InvalidArgument(f"stop_token_ids must be a sequence of token ids, got {stops!r}")
        stops = tuple(stops)
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(stops)}")
        bad = next((s for s in stops if not _is_int(s) or not 0 <= s <= MAX_TOKEN_ID), None)
        if bad is not None:
            raise InvalidArgument(f"stop_token_ids must be token ids in 0..{MAX_TOKEN_ID}, got {bad!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))

    def checked(self) -> "SamplingParams":
        """These values checked again, as a copy: a cluster calls it where a request
        enters, so that an object forced past the constructor (``object.__setattr__``)
        fails that request there, typed, instead of reaching the wire, where this class is
        the frame's type and a bad value would be a protocol error on the connection."""
        return replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
