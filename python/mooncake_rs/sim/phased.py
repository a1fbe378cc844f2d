"""A workload whose input/output mix shifts over time: consecutive phases, each with its
own arrival rate and prompt / output length ranges (uniform), Poisson arrivals. Every
request has its own blocks (no prefix reuse), so what the phases change is only the
balance of prefill work against decode work — the question adaptive roles answer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument
from .trace import BLOCK_TOKENS, Request

__all__ = ["Phase", "phased_trace", "SHIFTING_PHASES"]


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate: float
    input_tokens: tuple[int, int]
    output_tokens: tuple[int, int]


#: long prompts / short outputs, then short prompts / long outputs, then back
SHIFTING_PHASES: tuple[Phase, ...] = (
    Phase(300.0, 1.0, (6000, 12000), (16, 64)),
    Phase(300.0, 4.0, (256, 1024), (600, 1200)),
    Phase(300.0, 1.0, (6000, 12000), (16, 64)),
)


def phased_trace(
    phases: Sequence[Phase] = SHIFTING_PHASES, *, seed: int = 0, block_tokens: int = BLOCK_TOKENS
) -> list[Request]:
    """The requests of ``phases`` back to back, deterministic for ``seed``."""
    if not phases:
        raise InvalidArgument("phased_trace needs at least one Phase")
    rng = random.Random(seed)
    out: list[Request] = []
    start = 0.0
    next_block = 1
    for ph in phases:
        if not (math.isfinite(ph.duration_s) and ph.duration_s > 0 and math.isfinite(ph.rate) and ph.rate > 0):
            raise InvalidArgument(f"a Phase needs duration_s > 0 and rate > 0, got {ph}")
        for lo, hi, name in (*ph.input_tokens, "input_tokens"), (*ph.output_tokens, "output_tokens"):
            if not (1 <= lo <= hi):
                raise InvalidArgument(f"Phase.{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        t = start
        while True:
            t += rng.expovariate(ph.rate)
            if t >= start + ph.duration_s:
                break
            inp = rng.randint(*ph.input_tokens)
            outl = rng.randint(*ph.output_tokens)
            nb = -(-inp // block_tokens)
            out.append(Request(round(t * 1000.0, 3), inp, outl, tuple(range(next_block, next_block + nb))))
            next_block += nb
        start += ph.duration_s
    return out
