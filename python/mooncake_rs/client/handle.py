"""The handle ``Cluster.submit`` returns: stream tokens (sync or async) or wait for the result."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator

from ..errors import InvalidArgument, MooncakeError, TransferTimeout

__all__ = ["RequestHandle", "wait_seconds"]

_END = object()


def wait_seconds(timeout: Any, what: str = "timeout") -> float | None:
    """A caller's timeout as what ``threading`` accepts: None (or +inf) waits forever;
    any positive finite value is accepted and clamped to ``threading.TIMEOUT_MAX``
    (``1e300`` means "practically forever", not an error). Zero or less means "do not
    wait"; NaN, bools and non-numbers are refused."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if math.isnan(t):
        raise InvalidArgument(f"{what} must be a number of seconds or None, got nan")
    if t == math.inf:
        return None
    return min(max(t, 0.0), threading.TIMEOUT_MAX)


def request_entry(prompt: Any, params: Any, timeout_s: Any) -> tuple[list[int], Any, float | None]:
    """What every cluster's ``submit`` (``Cluster``, ``RemoteCluster``) checks where a
    request enters, before anything is sent: the prompt as token ids, the parameters
    (None: the defaults) checked again (``SamplingParams.checked``: they go on the wire as
    they are) and the deadline, positive or None. Returns (tokens, params, wait)."""
    from ..base.params import SamplingParams
    from ..engine.tokens import prompt_tokens

    params = params or SamplingParams()
    toks = prompt_tokens(prompt, params)
    wait = wait_seconds(timeout_s, "timeout_s")
    if wait is not None and wait <= 0:
        raise InvalidArgument(f"timeout_s must be positive (or None for no deadline), got {timeout_s!r}")
    return toks, params.checked(), wait


class RequestHandle:
    """One submitted request. Iterate it (``for tok in h`` / ``async for tok in h``) for
    its token ids as they come; :meth:`result` waits for the :class:`RequestOutput`.
    A failed request raises its error from the iteration and from ``result``.
    :meth:`cancel` ends the request wherever it runs; so does a ``result`` that times out."""

    def __init__(self, request_id: int, prompt: list[int],
                 on_cancel: Callable[[int, BaseException, str], None] | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self._on_cancel = on_cancel  # the cluster: frees the request's slots, pages and conductor entry
        self.prefill_instance = -1  # where the conductor sent it
        self.decode_instance = -1
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the router puts a token per token
        self._ended = False
        self._output: Any = None
        self._error: BaseException | None = None
        self._end = threading.Lock()  # the router (finish/fail) and a cancelling caller race to end it
        # held until the request ends; ``result`` waits by acquiring it (and lets it go for
        # the next waiter). A plain lock: releasing one costs the router far less than
        # setting a threading.Event (a condition variable and its lock)
        self._latch = threading.Lock()
        self._latch.acquire()
        # called (from the producer's thread) after each item is queued, while an async
        # consumer waits on the event loop: no thread per streaming request
        self._waker: Callable[[], None] | None = None

    # ---- producer side (the cluster)
    def _put(self, item: Any) -> None:
        self._q.put(item)
        wake = self._waker
        if wake is not None:
            wake()

    def _token(self, tok: int) -> None:
        self._put(tok)

    def _finish(self, output: Any) -> None:
        with self._end:
            if self._ended:  # cancelled (or failed) first: that is what the caller saw
                return
            self._output = output
            self._ended = True
        self._latch.release()
        self._put(_END)

    def _fail(self, error: BaseException) -> None:
        with self._end:
            if self._ended:
                return
            self._error = error
            self._ended = True
        self._latch.release()
        self._put(_END)

    def _wait(self, timeout: float | None) -> bool:
        """Waits until the request ended (``timeout`` as ``wait_seconds`` gives it)."""
        if self._ended:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
            return self._ended
        self._latch.release()  # the next waiter passes too
        return True

    # ---- consumer side
    @property
    def done(self) -> bool:
        return self._ended

    def cancel(self, error: BaseException | None = None, *, failed: bool | None = None) -> bool:
        """Cancels the request on every instance it lives on (the cluster frees its slots
        and pages and tells the conductor); iteration and ``result`` then raise ``error``
        (default: ``MooncakeError("... was cancelled")``). False if it had already ended.

        The cluster's metrics count it as ``cancelled`` (ended early on purpose: a stop
        string, a client gone; not a failure), or as ``failed`` when ``failed=True``. By
        default (``failed=None``) a ``TransferTimeout`` error is a deadline passed: counted
        as ``failed`` and ``timed_out``; any other error, or none, as ``cancelled``."""
        if self._ended:
            return False
        err = error if error is not None else MooncakeError(f"request {self.request_id} was cancelled")
        if failed is None:
            outcome = "timed_out" if isinstance(err, TransferTimeout) else "cancelled"
        elif failed:
            outcome = "timed_out" if isinstance(err, TransferTimeout) else "failed"
        else:
            outcome = "cancelled"
        if self._on_cancel is not None:
            self._on_cancel(self.request_id, err, outcome)
        self._fail(err)
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The ``RequestOutput``, waiting up to ``timeout`` seconds (None: forever). A
        request that does not finish in time is cancelled (it does not keep running) and
        ``TransferTimeout`` (a ``TimeoutError``) is raised; poll with :attr:`done` instead
        to wait without a deadline."""
        wait = wait_seconds(timeout)
        if not self._wait(wait):
            self.cancel(TransferTimeout(f"request {self.request_id} did not finish within {timeout}s; "
                                        "it was cancelled"))
        if self._error is not None:
            raise self._error
        return self._output

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._q.get()
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[int]:
        async for batch in self.batches():
            for tok in batch:
                yield tok

    async def batches(self) -> AsyncIterator[list[int]]:
        """The tokens as lists of those that arrived together, awaited on the running
        event loop (the producer wakes it; no thread waits). One async consumer at a time."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            # a racy read is fine: the consumer clears before it looks at the queue, so a
            # stale "set" means it has not waited yet and will see the item
            if not ready.is_set():
                try:
                    loop.call_soon_threadsafe(ready.set)
                except RuntimeError:  # the loop is closed: nobody is listening
                    pass

        self._waker = wake
        try:
            while True:
                ready.clear()
                items: list[Any] = []
                try:
                    while True:
                        items.append(self._q.get_nowait())
                except queue.Empty:
                    pass
                if not items:
                    await ready.wait()
                    continue
                # The end marker may not be last: a cancel from another thread ends the
                # handle while the producer still delivers a token it had (queued behind
                # the marker). The stream ends at the marker, as the sync one does.
                end = _END in items
                toks = items[:items.index(_END)] if end else items
                if toks:
                    yield toks
                if end:
                    if self._error is not None:
                        raise self._error
                    return
        finally:
            self._waker = None

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done else "running")
        return f"RequestHandle({self.request_id}, {state})"
