"""One request's run through the cluster: token ids in, text deltas out.

The cluster streams token ids on a ``RequestHandle``; this turns them into text with an
:class:`IncrementalDetokenizer`, ends the output at a stop string (cancelling the
request, so the instances stop generating for it), hides the EOS / stop token, and keeps
the counts ``usage`` reports. ``close()`` cancels a request that is still running: the
HTTP layer calls it when the client goes away.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..errors import MooncakeError
from ..text import IncrementalDetokenizer, StopStrings

__all__ = ["Generation", "Delta"]


@dataclass
class Delta:
    """A piece of output: ``text`` (may be empty), and on the last one ``finish_reason``
    (``stop``: EOS, a stop token or a stop string; ``length``: max_tokens or the context)."""

    text: str
    finish_reason: str | None = None


class Generation:
    def __init__(self, handle: Any, tokenizer: Any, *, prompt_tokens: int, stop: list[str], hidden_ids: frozenset[int],
                 on_first_token: Any = None) -> None:
        self.handle = handle
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.created = int(time.time())
        self._detok = IncrementalDetokenizer(tokenizer, context=handle.prompt_token_ids[-4:])
        self._stops = StopStrings(stop)
        self._hidden = hidden_ids  # EOS and stop token ids: they end the output, they are not text
        self._on_first = on_first_token
        self._closed = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused from a store instead of computed (``usage``'s
        ``prompt_tokens_details.cached_tokens``), from the finished request's metrics; 0
        while it runs or when it ended without an output (a stop string cancels it)."""
        if not self.handle.done:
            return 0
        try:
            out = self.handle.result(0)
        except Exception:  # noqa: BLE001 - cancelled or failed: no metrics to report
            return 0
        return int(out.metrics.reused_tokens)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stops.stopped

    def close(self, reason: str = "the client went away") -> None:
        """Cancels the request if it is still running (its slots, pages and conductor entry
        are freed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.handle.done:
            # ended early on purpose (a stop string, a client gone): the cluster counts it
            # as cancelled, not as a failure
            self.handle.cancel(MooncakeError(f"request {self.handle.request_id} cancelled: {reason}"), failed=False)

    async def _batches(self) -> AsyncIterator[list[int]]:
        """The handle's tokens, as lists of those that arrived together.

        One thread per request iterates the handle (blocking) and hands each token to the
        event loop; the loop side takes every token already there at once, so a busy
        server sends fewer, larger chunks instead of falling behind one frame per token."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is gone (server shutdown): nobody is listening
                pass

        def pump() -> None:
            try:
                for tok in self.handle:
                    put(tok)
                put(_END)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                put(_Failed(e))

        threading.Thread(target=pump, name=f"mooncake-front-{self.handle.request_id}", daemon=True).start()
        while True:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            toks = [t for t in items if isinstance(t, int)]
            if toks:
                yield toks
            last = items[-1]
            if last is _END:
                return
            if isinstance(last, _Failed):
                raise last.error

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas as tokens arrive; the last one carries ``finish_reason``. Errors of
        the request (an instance lost, a timeout) propagate."""
        try:
            async for batch in self._batches():
                parts = []
                first = self.completion_tokens == 0
                for tok in batch:
                    self.completion_tokens += 1
                    if self.completion_tokens == 1 and self._on_first is not None:
                        self._on_first()
                    if tok in self._hidden:
                        continue  # the request ends with it (the engine stops on these ids)
                    text, hit = self._stops.feed(self._detok.push((tok,)))
                    parts.append(text)
                    if hit:
                        self.finish_reason = "stop"
                        self.close("a stop string was reached")
                        yield Delta("".join(parts), "stop")
                        return
                text = "".join(parts)
                if text or first:
                    yield Delta(text)  # the first token goes out at once (TTFT) even if its text is held
            out = self.handle.result(0)
            reason = getattr(out, "finish_reason", None)
            self.finish_reason = reason if reason in ("stop", "length") else "stop"
            tail, hit = self._stops.feed(self._detok.flush())
            if hit:
                self.finish_reason = "stop"
            yield Delta(tail + ("" if hit else self._stops.flush()), self.finish_reason)
        finally:
            self.close()


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error
