"""The handle ``Cluster.submit`` returns: stream tokens (sync or async) or wait for the result."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, AsyncIterator, Iterator

__all__ = ["RequestHandle"]

_END = object()


class RequestHandle:
    """One submitted request. Iterate it (``for tok in h`` / ``async for tok in h``) for
    its token ids as they come; :meth:`result` waits for the :class:`RequestOutput`.
    A failed request raises its error from the iteration and from ``result``."""

    def __init__(self, request_id: int, prompt: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.prefill_instance = -1  # where the conductor sent it
        self.decode_instance = -1
        self._q: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self._output: Any = None
        self._error: BaseException | None = None

    # ---- producer side (the cluster)
    def _token(self, tok: int) -> None:
        self._q.put(tok)

    def _finish(self, output: Any) -> None:
        self._output = output
        self._done.set()
        self._q.put(_END)

    def _fail(self, error: BaseException) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()
        self._q.put(_END)

    # ---- consumer side
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
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
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                item = await asyncio.to_thread(self._q.get)
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done else "running")
        return f"RequestHandle({self.request_id}, {state})"
