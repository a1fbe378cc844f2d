"""Shared helpers of the ``serve --upstream`` tests (bounded waits, a free local port)."""

from __future__ import annotations

import time

from ports import free_port  # noqa: F401  (the upstream tests import it from here)

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

