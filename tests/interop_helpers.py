"""A stand-in KV event publisher for tests: XPUB (so we know when a subscriber joined)
plus a replay ROUTER served by a thread, all on 127.0.0.1, everything bounded in time."""

from __future__ import annotations

import threading
import time

import zmq

from mooncake_rs.kv_events.encode import encode_message

END = (-1).to_bytes(8, "big", signed=True)


class FakePublisher:
    """``reply_shape``: ``"plain"`` replays ``[seq, payload]`` and ends with ``[END, b""]``;
    ``"vllm"`` as vLLM 0.32: ``[topic, seq, payload]``, ending ``[b"", END, b""]``.
    ``endless``: the replay endpoint never ends its answer (it repeats its first message)."""

    def __init__(self, replay: bool = True, keep: int | None = None, reply_shape: str = "plain",
                 endless: bool = False) -> None:
        self.reply_shape = reply_shape
        self.endless = endless
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.keep = keep  # replay buffer depth (None: everything)
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay:
            ready = threading.Event()
            holder: dict[str, str] = {}
            self._thread = threading.Thread(target=self._serve, args=(ready, holder), daemon=True)
            self._thread.start()
            assert ready.wait(5)
            self.replay_endpoint = holder["endpoint"]

    def _serve(self, ready: threading.Event, holder: dict[str, str]) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        holder["endpoint"] = f"tcp://127.0.0.1:{port}"
        ready.set()
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                ident, empty, start = router.recv_multipart()
                s = int.from_bytes(start, "big")
                with self._lock:
                    self.replay_requests.append(s)
                    buf = list(self.buffer if self.keep is None else self.buffer[-self.keep:])
                topic = [b"kv"] if self.reply_shape == "vllm" else []
                for seq, payload in buf:
                    if seq >= s:
                        router.send_multipart([ident, b"", *topic, seq.to_bytes(8, "big"), payload])
                while self.endless and buf and not self._stop.is_set():
                    seq, payload = buf[0]
                    router.send_multipart([ident, b"", *topic, seq.to_bytes(8, "big"), payload])
                    time.sleep(0.001)
                end = [b""] if self.reply_shape == "vllm" else []
                router.send_multipart([ident, b"", *end, END, b""])
        finally:
            router.close(0)

    def wait_subscriber(self, timeout_s: float = 5.0) -> None:
        """Block until a SUB has joined (its subscription reaches the XPUB)."""
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined")
        self.pub.recv()

    def publish(self, seq: int, payload: bytes, send: bool = True) -> None:
        """Buffer for replay; send on the PUB unless ``send`` is False (a lost message)."""
        with self._lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart(encode_message(seq, payload))

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(0)
        self.ctx.term()


def pump(sub, until, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``sub`` until ``until()`` holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        sub.poll(0.02)
