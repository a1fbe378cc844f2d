"""The inference engine of one instance (torch; FlashInfer on CUDA when installed).

``import mooncake_rs.engine`` does not import torch: the types a client needs
(``SamplingParams``, ``RequestOutput``, ``BlockLayout``, ``ModelConfig``, ...) live in
the torch-free bottom layer (:mod:`mooncake_rs.base`) and are imported here, as the
engine's API; ``Engine`` and ``KVCache`` (and the torch-using submodules) are
imported on first access, through the module ``__getattr__`` below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..base.layout import BlockLayout, LayerSpan
from ..base.model_config import PRESETS, ModelConfig
from ..base.outputs import LayerEvent, PrefillTiming, RequestOutput, TokenEvent
from ..base.params import SamplingParams

if TYPE_CHECKING:  # for type checkers; at run time these load on first access
    from .engine import Engine
    from .kv_cache import KVCache

__all__ = ["Engine", "ModelConfig", "PRESETS", "SamplingParams", "RequestOutput", "TokenEvent", "LayerEvent",
           "PrefillTiming", "BlockLayout", "LayerSpan", "KVCache"]

#: names that import torch, and the submodule each comes from
_LAZY = {"Engine": "engine", "KVCache": "kv_cache"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
