"""What an external engine tells about itself that routing needs: its KV block size and
the LoRA adapters it serves.

Our chain must cut prompts into the blocks the engine caches, or no hash will ever
match. A user may give ``--block-size``; when they do not, we ask the engine:

1. its Prometheus ``/metrics``: vLLM exports ``vllm:cache_config_info`` with a
   ``block_size`` label (available as soon as the server is up, before any request);
2. its KV event replay buffer: the ``block_size`` of the first ``BlockStored`` it still
   holds (an engine that published events before we started).

Both are bounded in time; :func:`discover_block_size` returns ``None`` when neither
answers, and the caller says what to pass instead.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request

from ..errors import MalformedEvent
from ..kv_events.events import REPLAY_END, BlockStored, decode_payload

__all__ = ["block_size_from_metrics", "block_size_from_replay", "discover_block_size", "lora_adapters"]

log = logging.getLogger("mooncake_rs.interop")

_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)


def block_size_from_metrics(url: str, timeout_s: float = 5.0) -> int | None:
    """The ``block_size`` label of vLLM's ``vllm:cache_config_info`` gauge at ``url/metrics``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            text = r.read(8 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.debug("no /metrics at %s: %s", url, e)
        return None
    m = _CACHE_INFO.search(text)
    return int(m.group(1)) if m else None


def block_size_from_replay(replay_endpoint: str, timeout_s: float = 2.0, max_replies: int = 1000) -> int | None:
    """The block size of the first ``BlockStored`` the engine's replay buffer still holds."""
    import zmq  # pyzmq only when events are used

    from ..kv_events.subscriber import _replay_reply

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        for _ in range(max_replies):
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                return None
            seq, payload = _replay_reply(sock.recv_multipart())
            if seq == REPLAY_END:
                return None
            for ev in decode_payload(payload).events:
                if isinstance(ev, BlockStored) and ev.block_size > 0:
                    return int(ev.block_size)
    except (zmq.ZMQError, MalformedEvent) as e:
        log.debug("no block size from the replay endpoint %s: %s", replay_endpoint, e)
    finally:
        sock.close(0)
    return None


def discover_block_size(url: str, replay_endpoint: str | None = None, timeout_s: float = 5.0) -> int | None:
    """The engine's KV block size from its metrics, else its replay buffer; ``None`` if neither says."""
    size = block_size_from_metrics(url, timeout_s)
    if size is None and replay_endpoint:
        size = block_size_from_replay(replay_endpoint, timeout_s)
    return size


def lora_adapters(url: str, timeout_s: float = 5.0) -> set[str]:
    """The names ``url/v1/models`` lists as LoRA adapters (a ``parent`` model; vLLM's cards)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as r:
            cards = json.loads(r.read(8 << 20)).get("data") or []
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        log.debug("no model list at %s: %s", url, e)
        return set()
    return {c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("parent")}
