"""What a client of a cluster and the cluster itself share, below ``serving``: the
request handle ``submit`` returns (handle.py) and ``generate`` over any ``submit``
(generate.py). Torch-free (see docs/design.md, the layers)."""

from __future__ import annotations

from .generate import GenerateMixin
from .handle import RequestHandle, request_entry, wait_seconds

__all__ = ["GenerateMixin", "RequestHandle", "request_entry", "wait_seconds"]
