"""Shared prompts and reference outputs for the serving tests."""

from __future__ import annotations

import os
import random
import threading
import time

BLOCK = 16
SHM = "/dev/shm"


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith("mooncake_rs.")}
    except OSError:
        return set()


def shared_prefix_prompts(n: int, *, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    sys_p = [rng.randrange(256) for _ in range(prefix_len)]
    return [sys_p + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def reference_outputs(prompts: list[list[int]], params, seed: int = 0) -> list[list[int]]:
    from mooncake_rs.engine import Engine, ModelConfig

    eng = Engine(ModelConfig.tiny(), block_size=BLOCK, seed=seed)
    return [o.token_ids for o in eng.generate(prompts, params)]


def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    """Polls ``cond`` every 20 ms until it is true; fails with ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.02)


class TransportGate:
    """Holds back the completion of every transport ``read`` or ``write`` (with spans)
    started while it is closed, until it is opened again: ``held`` names them by
    (transport id, tag); ``calls`` counts the operations started."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.held: set[tuple[int, int]] = set()
        self.calls = 0


def gate_transport(monkeypatch, op: str) -> TransportGate:
    """Wraps ``Transport.<op>`` (``"read"`` or ``"write"``) and ``Transport.pending`` so
    that an operation started while the gate is closed reports itself pending until the
    gate opens; the bytes themselves move as without the gate."""
    from mooncake_rs.serving import transport as T

    gate = TransportGate()
    real_pending = T.Transport.pending
    native = getattr(T.Transport, op)

    def start(self, tag, ep, spans):
        gate.calls += 1
        native(self, tag, ep, spans)
        if spans and not gate.open.is_set():
            gate.held.add((id(self), tag))

    def pending(self, tag):
        if (id(self), tag) in gate.held:
            if not gate.open.is_set():
                return 1
            gate.held.discard((id(self), tag))
        return real_pending(self, tag)

    monkeypatch.setattr(T.Transport, op, start)
    monkeypatch.setattr(T.Transport, "pending", pending)
    return gate
