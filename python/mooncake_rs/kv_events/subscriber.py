"""A ZMQ SUB client of one engine's KV event publisher, with gap detection and replay.

Sequence numbers are per publisher and consecutive. When one is skipped we ask the
engine's replay endpoint (a ROUTER; we connect as a REQ would, send the first missing sequence
number as 8 big-endian bytes and read ``[seq, payload]`` or ``[topic, seq, payload]``
replies until the sequence -1) for what we missed, within a time and count bound. If no replay endpoint is configured, it does not answer in time, or
it no longer has the first missing batch, the instance's index entries are dropped
(``Ingestor.reset``: logged and counted) and rebuilt from the events that follow; the
index then under-reports what the engine holds until it stores again, which only costs a
worse routing choice, never a wrong hit. A sequence number that goes backwards means
the publisher restarted, which is handled the same way, and so is a publisher that
disconnects (a ZMQ socket monitor sees it at once): a stopped or restarted engine's
entries go without waiting for its next event.

Sockets are owned by the thread that polls them: call :meth:`poll` from one thread, or
:meth:`start` a background thread and :meth:`stop` it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import InvalidArgument, MalformedEvent
from .events import REPLAY_END, decode_message, decode_seq
from .ingest import Ingestor

__all__ = ["KVEventSubscriber", "SubscriberStats"]

log = logging.getLogger("mooncake_rs.kv_events")


@dataclass
class SubscriberStats:
    messages: int = 0
    gaps: int = 0
    replayed: int = 0
    """Batches recovered through the replay endpoint."""
    replay_failures: int = 0
    """Gaps the replay could not fill (the instance was reset)."""
    restarts: int = 0
    duplicates: int = 0
    disconnects: int = 0
    """Times the publisher went away (each dropped the instance's entries)."""
    malformed: int = 0
    """Messages that did not decode (skipped and logged)."""
    caught_up: bool = False
    """The catch-up at start is over (replayed, given up, or not asked for): from now on the
    ingested counts grow only with what the engine publishes."""


def _replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """One reply of a replay ROUTER, as a DEALER receives it: ``(seq, payload)``.

    Two shapes are in use, after the empty delimiter frame: ``[seq, payload]`` (SGLang,
    our own publisher) and ``[topic, seq, payload]`` (vLLM 0.32). The end is the sequence
    :data:`REPLAY_END` (vLLM sends it as ``[b"", REPLAY_END, b""]``).
    """
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 2:
        return decode_seq(frames[0]), frames[1]
    if len(frames) == 3:
        return decode_seq(frames[1]), frames[2]
    raise MalformedEvent(
        f"a replay reply has [seq, payload] or [topic, seq, payload] after the delimiter, got {len(frames)} frames")


class KVEventSubscriber:
    """Subscribes to ``endpoint`` and feeds ``ingestor``; replays gaps from ``replay_endpoint``."""

    def __init__(
        self,
        endpoint: str,
        ingestor: Ingestor,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        context: zmq.Context | None = None,  # type: ignore[type-arg]
        replay_timeout_s: float = 2.0,
        rcvhwm: int = 100_000,
        catch_up: bool = True,
        replay_max_s: float = 10.0,
        replay_max_messages: int = 100_000,
    ) -> None:
        if not endpoint:
            raise InvalidArgument("a KV event subscriber needs an endpoint such as tcp://host:5557")
        if replay_timeout_s <= 0:
            raise InvalidArgument(f"replay_timeout_s must be > 0, got {replay_timeout_s}")
        if replay_max_s <= 0 or replay_max_messages < 1:
            raise InvalidArgument(f"replay_max_s must be > 0 and replay_max_messages >= 1, got {replay_max_s}, "
                                  f"{replay_max_messages}")
        self.replay_max_s = replay_max_s
        """One replay's whole time budget (an endpoint that keeps answering is cut off)."""
        self.replay_max_messages = replay_max_messages
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.ingestor = ingestor
        self.replay_timeout_s = replay_timeout_s
        self.catch_up = catch_up
        """On the first message (sequence > 0), replay what the engine still buffers."""
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as e:
            self._sub.close(0)
            raise InvalidArgument(f"cannot connect to KV event endpoint {endpoint!r}: {e}") from None
        # A publisher that goes away (its engine stopped, crashed or is restarting) took its
        # cache with it: the monitor tells us at once, not at the engine's next event.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._join_replay = catch_up and self.replay_endpoint is not None
        """Catch up on the first poll, before any live message (an idle engine sends none)."""
        self._last: int | None = None  # highest sequence number applied
        self._sub_last: int | None = None  # highest seen on the SUB socket itself
        self.stats = SubscriberStats(caught_up=not self._join_replay)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False

    @property
    def last_seq(self) -> int | None:
        return self._last

    # --- receiving ---------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0, max_messages: int | None = None) -> int:
        """Handle the messages that arrive within ``timeout_s``; returns how many."""
        n = 0
        last: list[bytes] = []
        deadline = time.monotonic() + max(timeout_s, 0.0)
        sub = self._sub
        if self._join_replay:
            self._join_replay = False
            self._catch_up()
            self.stats.caught_up = True
        while max_messages is None or n < max_messages:
            self._check_monitor()
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # Wake for a message or for the publisher going away, whichever first.
                zmq.select([sub, self._monitor], [], [], left)
                continue
            self._handle(frames)
            n += 1
            last = frames
        if n and len(last) == 3:
            self.ingestor.check_block_size(last[2])
        return n

    def _catch_up(self) -> None:
        """Joining: apply what the engine's replay buffer holds from its start."""
        if self._replay(0, 0, from_start=True):
            return
        self.stats.replay_failures += 1
        if self._last is not None:  # part of the history came, then it stopped
            self.ingestor.reset(f"catch-up replay stopped at {self._last}")
            self._last = None

    def _check_monitor(self) -> None:
        """The publisher disconnected: drop the instance's entries now (its engine is gone,
        or restarting with an empty cache); what it publishes after reconnecting is a new
        stream (caught up through replay if it is the same engine)."""
        went_away = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            went_away |= event["event"] == zmq.EVENT_DISCONNECTED
        if went_away:
            self.stats.disconnects += 1
            self.ingestor.reset(f"the publisher at {self.endpoint} went away")
            self._last = self._sub_last = None

    def _handle(self, frames: list[bytes]) -> None:
        self.stats.messages += 1
        if len(frames) == 3 and len(frames[1]) == 8:
            s = int.from_bytes(frames[1], "big")
            last = self._last
            if last is not None and s == last + 1 and (self._sub_last is None or s > self._sub_last):
                # The common case, the next message in order: one Rust call decodes and
                # applies it (a payload that does not decode changes nothing and is
                # skipped; its sequence number still counts as seen, as below).
                self._sub_last = s
                self._apply(frames[2])
                self._last = s
                return
        try:
            msg = decode_message(frames, raw_tokens=True)
        except MalformedEvent as e:
            # Skip it: we cannot know what it held. Its sequence number, if readable,
            # still counts as seen so the next message is not taken for a gap.
            self.stats.malformed += 1
            log.warning("KV events from %s: %s", self.endpoint, e)
            if len(frames) == 3 and len(frames[1]) == 8:
                s = decode_seq(frames[1])
                self._sub_last = s
                self._last = s if self._last is None else max(self._last, s)
            return
        s = msg.seq
        sub_last, self._sub_last = self._sub_last, s
        if self._last is None:
            if s > 0 and self.catch_up and self.replay_endpoint is not None:
                # Joining a running engine: fetch what it still buffers from before.
                done = self._replay(0, s, from_start=True)
                if not done:
                    self.stats.replay_failures += 1
                if self._last is not None and s <= self._last:
                    return
                if not done and self._last is not None:
                    # Part of the history came back, then the replay failed: what we
                    # applied may be missing later removals.
                    self.ingestor.reset(f"catch-up replay stopped at {self._last}, before {s}")
            self._apply(frames[2])
            self._last = s
            return
        if sub_last is not None and s <= sub_last:
            self.stats.restarts += 1
            self.ingestor.reset(f"sequence went back from {sub_last} to {s} (publisher restarted)")
            self._apply(frames[2])
            self._last = s
            return
        if s <= self._last:  # already applied from a replay
            self.stats.duplicates += 1
            return
        if s > self._last + 1:
            self.stats.gaps += 1
            if not self._replay(self._last + 1, s):
                self.stats.replay_failures += 1
                self.ingestor.reset(f"missed sequence numbers {self._last + 1}..{s - 1}"
                                    + ("" if self.replay_endpoint else " and no replay endpoint is configured"))
                self._apply(frames[2])
                self._last = s
                return
            if s <= self._last:  # the replay already delivered it
                return
        self._apply(frames[2])
        self._last = s

    def _apply(self, payload: bytes) -> None:
        try:
            self.ingestor.apply_payload(payload)
        except MalformedEvent as e:  # it does not decode, or an event's token_ids do not: skip the rest
            self.stats.malformed += 1
            log.warning("KV events from %s: %s", self.endpoint, e)

    def _replay(self, start: int, upto: int, from_start: bool = False) -> bool:
        """Fetch and apply batches ``start..`` from the replay endpoint; True if ``start..upto-1`` arrived.

        ``from_start``: catching up after joining, so a buffer that begins later than
        ``start`` is fine (we never had those events anyway): apply what it has.

        Bounded: it gives up after ``replay_max_s`` in all, ``replay_max_messages``
        replies, or as soon as :meth:`stop` is called, so an endpoint that keeps answering
        cannot stall the subscriber; live messages wait in the SUB socket's queue meanwhile
        and are applied right after. Every way it can fail is counted in
        ``stats.replay_failures`` by the caller (a False return).
        """
        if self.replay_endpoint is None:
            return False
        # A DEALER speaking the REQ envelope (an empty delimiter frame first): a strict
        # REQ socket would accept only the first of the many replies the ROUTER sends.
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        timeout_ms = max(1, int(self.replay_timeout_s * 1000))
        req.setsockopt(zmq.SNDTIMEO, timeout_ms)
        expect = start
        deadline = time.monotonic() + self.replay_max_s
        replies = 0
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if self._stop.is_set():
                    log.warning("KV event replay from %s stopped: the subscriber is stopping", self.replay_endpoint)
                    return False
                left = deadline - time.monotonic()
                if left <= 0 or replies >= self.replay_max_messages:
                    log.warning("KV event replay from %s gave up after %d replies in %.1f s (bounds: %d, %.1f s)",
                                self.replay_endpoint, replies, self.replay_max_s - max(left, 0.0),
                                self.replay_max_messages, self.replay_max_s)
                    return False
                if not req.poll(min(timeout_ms, max(1, int(left * 1000)))):
                    log.warning("KV event replay from %s: no reply within %.1f s", self.replay_endpoint,
                                min(self.replay_timeout_s, left))
                    return False
                s, payload = _replay_reply(req.recv_multipart())
                replies += 1
                if s == REPLAY_END:
                    break
                if s < expect:
                    continue
                if s > expect and from_start and expect == start:
                    expect = s  # the engine's buffer starts later: take what it has
                if s > expect:
                    # The engine's buffer no longer holds ``expect``: the gap stays.
                    log.warning("KV event replay from %s starts at %d, needed %d", self.replay_endpoint, s, expect)
                    return False
                self.ingestor.apply_payload(payload)
                self._last = s
                self.stats.replayed += 1
                expect = s + 1
        except (zmq.ZMQError, MalformedEvent) as e:
            log.warning("KV event replay from %s failed: %s", self.replay_endpoint, e)
            return False
        finally:
            req.close(0)
        return expect >= upto

    # --- background thread -------------------------------------------------------

    def start(self) -> None:
        """Poll in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            raise InvalidArgument("this subscriber is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll(0.05)
        except Exception:  # noqa: BLE001 - a dying thread must say why
            log.exception("KV event subscriber of %s stopped", self.endpoint)
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(0)
        self._sub.close(0)
        self._closed = True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (if started) and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # it checks the flag at least every replay_timeout_s
                log.warning("KV event subscriber of %s did not stop within %.1f s", self.endpoint, timeout_s)
            self._thread = None
        elif not self._closed:
            self._close_sockets()

    close = stop

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *_args: object) -> None:
        self.stop()
