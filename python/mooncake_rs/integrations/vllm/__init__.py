"""vLLM's KV on mooncake_rs: ``MooncakeRsConnector`` (a ``KVConnectorBase_V1``).

The only package of mooncake_rs that imports torch and vLLM; see connector.py for how
vLLM loads it and docs/vllm.md for the whole picture."""

from .connector import MooncakeRsConnector

__all__ = ["MooncakeRsConnector"]
