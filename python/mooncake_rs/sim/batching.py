"""Continuous batching of decode steps on one simulated instance, in closed form.

Every step, each sequence in the batch produces one token; a step takes
``base_s + per_seq_s * B + per_token_s * C`` (the decode cost model) where B is the
batch size and C the total context. With B fixed, C grows by B each step, so the time
of k steps is ``k * alpha + beta * k * (k - 1) / 2``: the batch advances from one
membership change (a join or a departure) to the next in one computation instead of
one event per step. Sequences join at the first step boundary after they arrive
(continuous batching: they do not wait for the batch to drain).

This is the GPU's side of the simulation (what a real engine's step loop would take),
not scheduling: the conductor is not involved here.
"""

from __future__ import annotations

import heapq
import math

from .._core import DecodeCostModel

__all__ = ["ContinuousBatch"]


class ContinuousBatch:
    """One instance's running decode batch. Times are virtual seconds."""

    __slots__ = ("base", "per_seq", "per_tok", "steps", "t0", "n", "ctx0", "members", "finish", "version", "gaps", "stalled")

    def __init__(self, model: DecodeCostModel) -> None:
        self.base = model.base_s
        self.per_seq = model.per_seq_s
        self.per_tok = model.per_token_s
        #: steps done when the current segment began, and that wall time
        self.steps = 0
        self.t0 = 0.0
        self.n = 0
        #: context at global step s is ctx0 + n * s
        self.ctx0 = 0.0
        #: rid -> (join step, join time, prompt tokens, index into gaps, first step time)
        self.members: dict[int, tuple[int, float, int, int, float]] = {}
        #: (finish step, rid)
        self.finish: list[tuple[int, int]] = []
        #: bumped whenever scheduled boundary events become stale
        self.version = 0
        #: the longest token gap of each closed segment (for per-request worst gaps)
        self.gaps: list[float] = []
        #: time the batch has stood still since its last step (added to the next gap)
        self.stalled = 0.0

    # --- the closed form ---

    def _alpha(self) -> float:
        return self.base + self.per_seq * self.n + self.per_tok * (self.ctx0 + self.n * self.steps)

    def span(self, k: int) -> float:
        """Seconds for the next ``k`` steps with the current batch."""
        beta = self.per_tok * self.n
        return k * self._alpha() + beta * k * (k - 1) / 2.0

    def steps_within(self, dt: float) -> int:
        """Whole steps that finish within ``dt`` seconds of the segment start."""
        if dt <= 0 or self.n == 0:
            return 0
        a = self._alpha()
        b = self.per_tok * self.n
        if b <= 1e-300:
            k = int(dt / a)
        else:
            h = a - b / 2.0
            k = int((-h + math.sqrt(h * h + 2.0 * b * dt)) / b)
        k = max(k, 0)
        while k > 0 and self.span(k) > dt:
            k -= 1
        while self.span(k + 1) <= dt:
            k += 1
        return k

    def boundary_after(self, t: float) -> tuple[int, float]:
        """(global step, time) of the first step boundary strictly after ``t``."""
        k = self.steps_within(t - self.t0) + 1
        return self.steps + k, self.t0 + self.span(k)

    def time_of(self, step: int) -> float:
        return self.t0 + self.span(step - self.steps)

    def next_finish_step(self) -> int | None:
        return self.finish[0][0] if self.finish else None

    # --- changes ---

    def advance_to(self, step: int) -> float:
        """Runs the batch to global ``step``; returns the wall time reached."""
        k = step - self.steps
        if k > 0:
            a = self._alpha()
            # step times grow within a segment: the last is the longest, unless the
            # first carries a stall
            self.gaps.append(max(a + self.stalled, a + self.per_tok * self.n * (k - 1)))
            self.stalled = 0.0
            self.t0 += self.span(k)
            self.steps = step
        return self.t0

    def run_one(self, extra_s: float = 0.0) -> float:
        """One step that also carries ``extra_s`` of other work (a chunked-prefill
        iteration); returns its duration."""
        d = self._alpha() + extra_s
        self.gaps.append(d + self.stalled)
        self.stalled = 0.0
        self.t0 += d
        self.steps += 1
        return d

    def stall(self, seconds: float) -> None:
        """The instance does something else for ``seconds`` (a prefill iteration):
        members wait, their token gaps include it."""
        self.t0 += seconds
        if self.n:
            self.stalled += seconds

    def idle_until(self, t: float) -> None:
        """With no members, the next segment starts at ``t``."""
        if self.n == 0:
            self.t0 = max(self.t0, t)

    def add(self, rid: int, prompt_tokens: int, tokens: int) -> None:
        """Adds a sequence at the current boundary that will decode ``tokens`` tokens."""
        if self.stalled and self.n:
            # the members already here see the stall in their next gap; the newcomer's
            # first token came after it
            self.gaps.append(self.stalled + self._alpha())
        self.stalled = 0.0
        self.n += 1
        self.ctx0 += prompt_tokens - self.steps
        self.members[rid] = (self.steps, self.t0, prompt_tokens, len(self.gaps), self._alpha())
        heapq.heappush(self.finish, (self.steps + tokens, rid))

    def pop_finished(self) -> list[tuple[int, float, int, float, float]]:
        """Sequences done at the current boundary: (rid, join time, tokens decoded,
        longest gap between two of its decoded tokens, duration of its first step)."""
        out = []
        while self.finish and self.finish[0][0] <= self.steps:
            _, rid = heapq.heappop(self.finish)
            join_step, join_t, prompt, gi, first = self.members.pop(rid)
            self.n -= 1
            self.ctx0 -= prompt - join_step
            worst = max(self.gaps[gi:], default=0.0)
            out.append((rid, join_t, self.steps - join_step, worst, first))
        if self.n == 0:
            self.ctx0 = 0.0
        return out
