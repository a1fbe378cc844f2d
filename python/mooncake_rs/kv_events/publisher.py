"""Publishing KV events in vLLM's wire format: a ZMQ PUB socket and a replay ROUTER, both
owned by one thread (ZMQ sockets are not thread-safe).

Used by our own instances (``serving/kv_events.py``, ``Cluster(kv_events=...)``) and by
the stand-in engine of the tests (``tests/standin.py``). It imports nothing of the
serving or HTTP layers, so both can use it without an import cycle.
"""

from __future__ import annotations

import queue
import threading
import time

import zmq

from .encode import Form, encode_batch, encode_message
from .events import KVEvent

__all__ = ["EventPublisher"]

_END = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    """PUB + replay ROUTER on 127.0.0.1, both owned by one thread (ZMQ sockets are not
    thread-safe): :meth:`publish` only queues. Keeps the last ``keep`` batches for replay."""

    def __init__(self, host: str = "127.0.0.1", form: Form = "positional", keep: int = 10_000, *,
                 endpoint: str | None = None, replay_endpoint: str | None = None) -> None:
        # ``endpoint`` / ``replay_endpoint``: bind these (``tcp://HOST:PORT``) instead of
        # random ports on ``host`` (our serving instances publish on configured ports).
        self.form = form
        self.keep = keep
        self._ctx = zmq.Context()
        self._q: queue.Queue[list[KVEvent] | None] = queue.Queue()
        self.sent = 0
        ready = threading.Event()
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, ready, endpoint, replay_endpoint),
                                        name="kv-events-pub", daemon=True)
        self._thread.start()
        if not ready.wait(10) or self._err is not None:
            self._ctx.term()
            raise RuntimeError(f"the KV event publisher did not start: {self._err}")

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self._q.put(events)

    def _run(self, host: str, ready: threading.Event, endpoint: str | None, replay_endpoint: str | None) -> None:
        pub: zmq.Socket[bytes] | None = None
        router: zmq.Socket[bytes] | None = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            router = self._ctx.socket(zmq.ROUTER)
            for sock in (pub, router):
                sock.setsockopt(zmq.LINGER, 0)
            if endpoint is None:
                self.endpoint = f"tcp://{host}:{pub.bind_to_random_port(f'tcp://{host}')}"
            else:
                pub.bind(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is None:
                self.replay_endpoint = f"tcp://{host}:{router.bind_to_random_port(f'tcp://{host}')}"
            else:
                router.bind(replay_endpoint)
                self.replay_endpoint = replay_endpoint
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._err = e
            if pub is not None:
                pub.close(0)
            if router is not None:
                router.close(0)
            ready.set()
            return
        assert pub is not None and router is not None  # bound above
        ready.set()
        buf: list[tuple[int, bytes]] = []
        seq = 0
        try:
            while True:
                while router.poll(0):
                    ident, _empty, start = router.recv_multipart()
                    s = int.from_bytes(start, "big")
                    for n, payload in buf:
                        if n >= s:
                            router.send_multipart([ident, b"", n.to_bytes(8, "big"), payload])
                    router.send_multipart([ident, b"", _END, b""])
                try:
                    events = self._q.get(timeout=0.01)
                except queue.Empty:
                    continue
                if events is None:
                    return
                payload = encode_batch(events, ts=time.time(), form=self.form)  # wall clock, as engines stamp it
                buf.append((seq, payload))
                del buf[:-self.keep]
                pub.send_multipart(encode_message(seq, payload))
                seq += 1
                self.sent = seq
        finally:
            pub.close(0)
            router.close(0)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5)
        self._ctx.term()
