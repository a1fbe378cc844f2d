"""Continuous batching inside one instance: admission, chunked prefill, preemption.

Every request is one token list (prompt, then generated tokens) and a count of tokens
whose KV is in the cache (``num_computed``). A step computes the next tokens of a set of
requests: one for a decoding request, up to the remaining budget for a prefilling one
(chunked prefill under ``max_num_batched_tokens``). When the pool runs out of pages, the
most recently admitted running request is preempted: its pages are freed and it goes
back to the front of the queue, to be recomputed from its tokens (prompt and the tokens
generated so far), so its output does not change.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .kv_cache import KVCache
from ..base.params import SamplingParams

__all__ = ["Request", "RequestStatus", "Scheduler", "ScheduledBatch"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    prefill_only: bool = False
    hold_kv: bool = False
    on_layer: Callable[[Any], None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV was loaded, not computed
    staged: list[tuple[int, torch.Tensor]] | None = None  # (tokens, bytes) loaded at admission
    num_preemptions: int = 0
    kv_end: int = 0  # tokens whose KV is (being) written this step

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without building the whole list."""
        plen = len(self.prompt_token_ids)
        if start >= plen:
            return self.output_token_ids[start - plen:end - plen]
        if end <= plen:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - plen]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new: list[int]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, cache: KVCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 load_staged: Callable[[Request], None]) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._load_staged = load_staged

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, new_tokens: int) -> bool:
        need = -(-(req.num_computed + new_tokens) // self.cache.page_size) - len(req.pages)
        if need <= 0:
            return True
        if need > self.cache.num_free:
            return False
        req.pages.extend(self.cache.allocate(need))
        return True

    def free(self, req: Request) -> None:
        self.cache.free(req.pages)
        req.pages = []

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.free(req)
        req.num_computed = 0
        req.num_cached_tokens = 0
        req.staged = None
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _reclaim_waiting(self, keep: Request | None) -> bool:
        """Frees the pages of the last waiting request that holds loaded KV (it will be
        recomputed instead). Returns False when no waiting request holds pages."""
        for req in reversed(self.waiting):
            if req.pages and req is not keep:
                self.free(req)
                req.num_computed = 0
                req.num_cached_tokens = 0
                return True
        return False

    def _want(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed, budget)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[Request] = []
        num_new: list[int] = []
        preempted: list[Request] = []
        # 1. running requests, oldest first; preempt the newest when pages run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, n):
                if self._reclaim_waiting(keep=None):
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            chosen.append(req)
            num_new.append(n)
            budget -= n
            i += 1
        # 2. admit waiting requests while there is room (no preemption for admission)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.staged is not None:
                need = sum(self.cache.pages_for(n) for n, _ in req.staged)
                if need > self.cache.num_free:
                    if self.running or not self._reclaim_waiting(keep=req):
                        break
                    continue
                self._load_staged(req)
            n = self._want(req, budget)
            if not self._grow(req, n):
                if self.running or not self._reclaim_waiting(keep=req):
                    break
                continue
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append(req)
            num_new.append(n)
            budget -= n
        return ScheduledBatch(chosen, num_new, preempted)

    def finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if not req.hold_kv:
            self.free(req)
