"""Typed results of the engine: request outputs, streamed tokens, layer events, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestOutput", "TokenEvent", "LayerEvent", "PrefillTiming", "FINISH_REASONS"]

#: ``stop`` (EOS or a stop token), ``length`` (max_tokens or the model's max positions),
#: ``prefill`` (a prefill-only request handed its KV off), ``abort``.
FINISH_REASONS = ("stop", "length", "prefill", "abort")


@dataclass
class RequestOutput:
    """A request's state after a step (or at the end of ``generate``).

    ``token_ids`` are the generated tokens so far (the prompt excluded); ``new_token_ids``
    those added by the step that produced this output. ``num_cached_tokens``: prompt
    tokens whose KV was loaded from buffers rather than computed. ``metrics`` is left for
    the serving layer to fill.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    metrics: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token of ``Engine.stream`` (``index``: the prompt's position in the call)."""

    index: int
    request_id: str
    token_id: int
    finish_reason: str | None = None


@dataclass(frozen=True)
class LayerEvent:
    """Layer ``layer`` of a step finished for a prefilling request.

    ``blocks``: indices of the prompt's full blocks completed in this step; their KV for
    this layer is final and can be saved (``Engine.save_block(request_id, i, buf, layer)``).
    ``partial_block`` / ``partial_tokens``: when the prompt's last, partial block was
    completed in this step, its index and token count (else ``None`` / 0).
    ``last``: the prompt's KV is complete once this layer's event has been handled.
    """

    request_id: str
    layer: int
    blocks: tuple[int, ...]
    partial_block: int | None = None
    partial_tokens: int = 0
    last: bool = False


@dataclass(frozen=True)
class PrefillTiming:
    """Measured time of prefilling ``new_tokens`` after ``cached_tokens`` of restored prefix."""

    new_tokens: int
    cached_tokens: int
    seconds: float
