"""Shared prompts and reference outputs for the serving tests."""

from __future__ import annotations

import os
import random
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
