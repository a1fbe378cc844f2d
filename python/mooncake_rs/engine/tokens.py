"""Token-id checks shared by the engine's entry points (and the cluster's, through them)."""

from __future__ import annotations

import operator
from typing import Any

from ..errors import InvalidArgument

__all__ = ["token_id"]


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
