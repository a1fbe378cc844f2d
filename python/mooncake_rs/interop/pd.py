"""Prefill/decode disaggregation over external engines (``serve --upstream`` with roles).

``--upstream prefill:NAME=URL[,events=...][,replay=...]`` and ``--upstream
decode:NAME=URL``: the prefill instances are routed by the conductor on their real KV
events (an :class:`.upstream.UpstreamRouter` over them: Algorithm 1's cache-aware choice
with their queues); the decode instance is the one with the fewest requests in flight
(load), skipping one marked down. The engines move the KV themselves, through
``MooncakeRsConnector`` and a KV pool (integrations/vllm): the proxy only carries vLLM's
``kv_transfer_params`` from the prefill's answer to the decode's request (pd_app.py).

Transport-free like upstream.py: pd_app.py is the ASGI app over it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument
from .upstream import UpstreamRouter, UpstreamSpec, parse_upstream

__all__ = ["ROLES", "is_role_spec", "parse_role_spec", "PDRouter", "DecodeChoice"]

ROLES = ("prefill", "decode")


def is_role_spec(text: str) -> bool:
    return text.split(":", 1)[0].strip() in ROLES and ":" in text.split("=", 1)[0]


def parse_role_spec(text: str) -> tuple[str, UpstreamSpec]:
    """``prefill:NAME=URL,...`` -> ("prefill", spec); ``decode:NAME=URL`` -> ("decode", spec)."""
    role, sep, rest = text.partition(":")
    role = role.strip()
    if not sep or role not in ROLES:
        raise InvalidArgument(f"--upstream {text!r}: expected prefill:NAME=URL[,events=...] or decode:NAME=URL")
    return role, parse_upstream(rest)


@dataclass
class _Decode:
    spec: UpstreamSpec
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    down_until: float = 0.0


@dataclass
class DecodeChoice:
    name: str
    url: str


class PDRouter:
    """The prefill router (conductor + KV events) and the decode pool (by load)."""

    def __init__(self, specs: Sequence[str], *, down_cooldown_s: float = 5.0, **router_kw: Any) -> None:
        parsed = [parse_role_spec(s) for s in specs]
        prefill = [s for r, s in parsed if r == "prefill"]
        decode = [s for r, s in parsed if r == "decode"]
        if not prefill or not decode:
            raise InvalidArgument("P/D needs at least one --upstream prefill:NAME=URL,events=... and one "
                                  "--upstream decode:NAME=URL")
        names = [s.name for s in decode]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"decode names must be unique, got {names}")
        self.prefill = UpstreamRouter(prefill, down_cooldown_s=down_cooldown_s, **router_kw)
        self._decode = {s.name: _Decode(s) for s in decode}
        self.down_cooldown_s = down_cooldown_s
        self._lock = threading.Lock()
        self.counters = {"pd_requests": 0, "prefill_fallbacks": 0, "decode_failures": 0}

    @property
    def decode_names(self) -> list[str]:
        return list(self._decode)

    def pick_decode(self, exclude: Sequence[str] = ()) -> DecodeChoice:
        now = time.monotonic()
        with self._lock:
            up = [d for d in self._decode.values() if d.spec.name not in exclude and d.down_until <= now]
            if not up:
                up = [d for d in self._decode.values() if d.spec.name not in exclude]
            if not up:
                raise InvalidArgument("no decode instance is left to try")
            d = min(up, key=lambda d: (d.in_flight, d.routed))
            d.in_flight += 1
            d.routed += 1
            return DecodeChoice(d.spec.name, d.spec.url)

    def decode_done(self, choice: DecodeChoice, *, failed: bool = False, unreachable: bool = False) -> None:
        with self._lock:
            d = self._decode[choice.name]
            d.in_flight -= 1
            if failed:
                d.failures += 1
                self.counters["decode_failures"] += 1
            if unreachable:
                d.down_until = time.monotonic() + self.down_cooldown_s

    def count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            decode = {d.spec.name: {"in_flight": d.in_flight, "routed": d.routed, "failures": d.failures,
                                    "down": d.down_until > now} for d in self._decode.values()}
            counters = dict(self.counters)
        return {"prefill": self.prefill.stats(), "decode": decode, "counters": counters}

    def close(self) -> None:
        self.prefill.close()

    def __enter__(self) -> PDRouter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
