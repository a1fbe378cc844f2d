"""Shared helpers of the ``serve --upstream`` tests (bounded waits, a free local port)."""

from __future__ import annotations

import socket
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
