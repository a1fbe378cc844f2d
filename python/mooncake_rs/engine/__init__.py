"""The inference engine of one instance (torch; FlashInfer on CUDA when installed).

``import mooncake_rs.engine`` does not import torch: the types a client needs
(``SamplingParams``, ``RequestOutput``, ``BlockLayout``, ``ModelConfig``, ...) live in
torch-free modules (:mod:`.params`, :mod:`.outputs`, :mod:`.layout`, :mod:`.config`) and
are imported here; ``Engine`` and ``KVCache`` (and the torch-using submodules) are
imported on first access, through the module ``__getattr__`` below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import PRESETS, ModelConfig
from .layout import BlockLayout, LayerSpan
from .outputs import LayerEvent, PrefillTiming, RequestOutput, TokenEvent
from .params import SamplingParams

if TYPE_CHECKING:  # for type checkers; at run time these load on first access
    from .engine import Engine
    from .kv_cache import KVCache

__all__ = ["Engine", "ModelConfig", "PRESETS", "SamplingParams", "RequestOutput", "TokenEvent", "LayerEvent",
           "PrefillTiming", "BlockLayout", "LayerSpan", "KVCache"]

#: names that import torch, and the submodule each comes from
_LAZY = {"Engine": "engine", "KVCache": "kv_cache"}
#: submodules that used to be loaded by ``import mooncake_rs.engine`` (so
#: ``mooncake_rs.engine.sampler`` worked as an attribute); they still resolve, lazily
_SUBMODULES = frozenset({"attention", "engine", "handoff", "kv_cache", "model", "sampler", "scheduler",
                         "tokens", "weights"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
