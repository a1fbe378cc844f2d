"""The OpenAI response objects: completions, chat completions, and their stream chunks.

One place builds every shape, so the streaming and non-streaming paths and the two
endpoints cannot drift apart. Server-sent events are ``data: <json>\\n\\n`` frames ending
with ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Shapes", "sse", "SSE_DONE"]

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens
    whose KV was reused rather than computed (as vLLM and OpenAI report prefix-cache hits)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shapes:
    """Builds the objects of one response (``kind``: ``completion`` or ``chat``)."""

    def __init__(self, kind: str, response_id: str, model: str, created: int) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + response_id
        self.model, self.created = model, created

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False,
              include_usage: bool = False) -> dict[str, Any]:
        """A stream chunk. With ``include_usage`` every chunk carries ``"usage": null``
        (the final usage chunk then carries the counts), as OpenAI streams do."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text:
                delta = {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body
