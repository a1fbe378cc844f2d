"""Token-id checks shared by the engine's entry points and the cluster's (torch-free: a
client process checks its prompts with these before routing them)."""

from __future__ import annotations

import operator
from typing import Any, Sequence

from ..errors import InvalidArgument
from ..base.params import SamplingParams

__all__ = ["token_id", "prompt_tokens"]


def token_id(t: Any) -> int:
    """``t`` as an int token id. Integers of any kind (int, numpy integers, 0-d integer
    tensors: whatever implements ``__index__``) are accepted; a float (1.5 must not quietly
    become 1), a bool or anything else is refused with ``InvalidArgument``."""
    if isinstance(t, bool) or type(t).__name__ == "bool_":
        raise InvalidArgument(f"token ids must be ints, got the bool {t!r}")
    try:
        return operator.index(t)
    except TypeError:
        raise InvalidArgument(f"token ids must be ints, got {t!r} ({type(t).__name__})") from None


def prompt_tokens(prompt: Sequence[int], params: SamplingParams) -> list[int]:
    """The prompt as a list of ints, with the checks that need no model (the engine adds
    vocabulary, length and page checks); the cluster uses it before routing."""
    if not isinstance(params, SamplingParams):
        raise InvalidArgument(f"params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, (str, bytes)):
        raise InvalidArgument("a prompt must be a list of int token ids, not a string (tokenize it first)")
    try:
        toks = [token_id(t) for t in prompt]
    except TypeError:
        raise InvalidArgument("a prompt must be a list of int token ids") from None
    if not toks:
        raise InvalidArgument("a prompt needs at least one token")
    return toks
