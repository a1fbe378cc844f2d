"""The inference engine of one instance (torch; FlashInfer on CUDA when installed).

Imported only when used: ``import mooncake_rs`` does not import torch.
"""

from __future__ import annotations

from .config import PRESETS, ModelConfig
from .engine import Engine
from .kv_cache import BlockLayout, KVCache, LayerSpan
from .outputs import LayerEvent, PrefillTiming, RequestOutput, TokenEvent
from .sampler import SamplingParams

__all__ = ["Engine", "ModelConfig", "PRESETS", "SamplingParams", "RequestOutput", "TokenEvent", "LayerEvent",
           "PrefillTiming", "BlockLayout", "LayerSpan", "KVCache"]
