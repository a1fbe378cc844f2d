"""``generate`` over any ``submit``: run a batch of prompts to completion, in order.

Shared by the embedded ``Cluster``, the ``serve`` process's conductor service and the
remote client (``client.remote.RemoteCluster``): each only has to provide
``submit(prompt, params, timeout_s=...) -> RequestHandle``. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgument, Overloaded, TransferTimeout
from .handle import RequestHandle, wait_seconds
from ..base.metrics import RequestMetrics

__all__ = ["GenerateMixin"]


class GenerateMixin:
    def submit(self, prompt: Sequence[int], params: Any = None, *,
               timeout_s: float | None = None) -> RequestHandle:  # pragma: no cover - provided by the class
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], params: Any = None, *,
                 on_reject: str = "raise", timeout_s: float | None = None) -> list[Any]:
        """Runs the prompts to completion; outputs in order. A rejected prompt raises
        ``Overloaded`` (``on_reject="raise"``) or yields an output with
        ``finish_reason="rejected"`` (``on_reject="report"``). ``timeout_s`` bounds the
        whole call: what has not finished by then is cancelled on the instances and
        ``TransferTimeout`` is raised. Whatever ends the call early (a rejection, a
        timeout, a failed request, KeyboardInterrupt) cancels the requests still running."""
        from ..base.outputs import RequestOutput
        from ..base.params import SamplingParams

        wait = wait_seconds(timeout_s, "timeout_s")
        if wait is not None and wait <= 0:
            raise InvalidArgument(f"timeout_s must be positive (or None to wait forever), got {timeout_s!r}")
        if on_reject not in ("raise", "report"):
            raise InvalidArgument("on_reject must be 'raise' or 'report'")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidArgument("prompts must be a list of token-id lists")
        plist = [params or SamplingParams()] * len(prompts) if params is None or isinstance(params, SamplingParams) \
            else list(params)
        if len(plist) != len(prompts):
            raise InvalidArgument(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        end = None if wait is None else time.monotonic() + wait
        handles: list[RequestHandle | RequestOutput] = []
        try:
            for p, sp in zip(prompts, plist):
                left = None if end is None else max(end - time.monotonic(), 1e-3)
                try:
                    handles.append(self.submit(p, sp, timeout_s=left))
                except Overloaded:
                    if on_reject == "raise":
                        raise
                    handles.append(RequestOutput("rejected", [int(t) for t in p], [], "rejected",
                                                 metrics=RequestMetrics()))
            return [h.result(None if end is None else max(end - time.monotonic(), 0.0))
                    if isinstance(h, RequestHandle) else h for h in handles]
        except BaseException as e:
            # past the call's deadline, the requests still running missed it too (counted
            # as timed out); otherwise they are collateral of the error: cancelled
            for h in handles:
                if isinstance(h, RequestHandle):
                    h.cancel(e if isinstance(e, TransferTimeout) else None)
            raise
