"""Shared helpers of the ``serve --upstream`` tests (bounded waits, a free local port)."""

from __future__ import annotations

import time

BS = 4
"""The block size of every upstream test (small prompts span several blocks)."""


def wait_for(pred, timeout_s=30.0, what="condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    """A free port for a server started a moment later: the one rule of vllm_support
    (below the kernel's own port range, so no outgoing connection takes it meanwhile)."""
    from vllm_support import free_port as below_ephemeral

    return below_ephemeral()
