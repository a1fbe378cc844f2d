"""Stop strings over streamed text, including ones that span token boundaries.

Text arrives in deltas (one per token or so). A stop string may begin in one delta and
end in a later one, so the tail of the text that could still grow into a stop string is
held back until it either does (the text before it is the end of the output) or cannot
any more (it is released).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import InvalidArgument

__all__ = ["StopStrings"]


class StopStrings:
    """``feed(delta) -> (text, stopped)``: the text that is safe to emit now and whether a
    stop string was reached (the output then ends before it; the stop string itself is
    not emitted). ``flush()`` releases the held tail when the stream ends otherwise."""

    def __init__(self, stops: Sequence[str]) -> None:
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop strings must be non-empty strings, got {s!r}")
        self.stops = tuple(dict.fromkeys(stops))
        self._pending = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        if not self.stops:
            return delta, False
        text = self._pending + delta
        # Generation ends at the first stop string to be completed (of two completed by
        # the same character, the one that began earlier), whatever the delta sizes.
        # Emitted text never held a stop string's start (its possible starts stay
        # pending), so searching the pending text finds it.
        first, best, which = -1, (0, 0), None
        for s in self.stops:
            i = text.find(s)
            if i != -1 and (which is None or (i + len(s), i) < best):
                first, best, which = i, (i + len(s), i), s
        if which is not None:
            self.stopped = which
            self._pending = ""
            return text[:first], True
        keep = self._held(text)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped is not None else out
