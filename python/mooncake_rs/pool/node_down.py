"""The error of a store node that could not be asked: links.py raises it, and its callers
(remote.py, spare_slots.py) treat that node as down for the request."""

from __future__ import annotations

__all__ = ["NodeDown"]


class NodeDown(Exception):
    """The node could not be asked (unreachable, closed, timed out, malformed answer)."""
