"""The bottom layer: the torch-free vocabulary every other package shares, and nothing
else. Sampling parameters (``SamplingParams``, also the wire type of a request's
parameters), outputs (``RequestOutput``, ``TokenEvent``, ...), a request's metrics
(``RequestMetrics``), the KV block layout (``BlockLayout``) and the model configuration
(``ModelConfig``, presets). It imports only ``mooncake_rs.errors``; every package may
import it (tests/test_imports.py checks the layering)."""

from .layout import BlockLayout, LayerSpan
from .metrics import RequestMetrics
from .model_config import PRESETS, ModelConfig
from .outputs import LayerEvent, PrefillTiming, RequestOutput, TokenEvent
from .params import SamplingParams

__all__ = ["BlockLayout", "LayerSpan", "RequestMetrics", "ModelConfig", "PRESETS", "LayerEvent", "PrefillTiming",
           "RequestOutput", "TokenEvent", "SamplingParams"]
