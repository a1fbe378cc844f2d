"""Incremental detokenization for streaming: token ids in, text deltas out.

Decoding each token on its own is wrong twice over: a byte-level token can hold part of
a multi-byte UTF-8 character (decoded alone it is U+FFFD), and some decoders drop or add
the space in front of a word depending on what precedes it. So the detokenizer decodes
a short window of recent tokens, emits only what that window's text gained, and holds
back a tail of U+FFFD that a later token may still complete into a character.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Tokens kept before the new ones when the window slides: enough context for word
# boundaries (the decoders we know look at one neighbour), small enough to stay cheap.
_CONTEXT = 4
# The window slides (one extra decode) once it holds this many tokens.
_SLIDE_AT = 24


class IncrementalDetokenizer:
    """``push(ids) -> str`` the text the new tokens completed; ``flush() -> str`` what is
    still held at the end (an unfinished character comes out as U+FFFD then).

    ``context``: token ids before the first pushed one (the prompt's tail), decoded as
    context only, so the first generated word gets its leading space right. The text
    joined from every ``push`` and the final ``flush`` equals
    ``decode(context + ids)[len(decode(context)):]`` for prefix-stable decoders (byte-level,
    metaspace, word-level), and no delta ends inside a character.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = list(context)[-_CONTEXT:]
        self._start = 0  # the window is self._ids[self._start:]
        self._sent = len(self._decode(self._ids))  # characters of the window's text already emitted

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(t) for t in ids)
        text = self._decode(self._ids[self._start:])
        safe = len(text)
        while safe > 0 and text[safe - 1] == _REPLACEMENT:
            safe -= 1  # possibly a character whose remaining bytes are still to come
        delta = text[self._sent:safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        if safe == len(text) and len(self._ids) - self._start >= _SLIDE_AT:
            # A clean boundary: everything in the window is out. Keep a little context.
            self._start = len(self._ids) - _CONTEXT
            self._sent = len(self._decode(self._ids[self._start:]))
        return delta

    def flush(self) -> str:
        """The held-back tail (the end of the stream: nothing more can complete it)."""
        text = self._decode(self._ids[self._start:])
        out = text[self._sent:]
        self._sent = len(text)
        return out
