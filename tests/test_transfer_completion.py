"""Completion tracking in the transfer engine: CompletionQueue, per-batch timestamps and
bytes, engine counters, and serving's Transport built on them (no waiter thread)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import mooncake_rs as mc
from mooncake_rs.serving import transport as tp
from mooncake_rs.serving.transport import Span, Transport

sys.path.insert(0, os.path.dirname(__file__))
from test_transfer_xproc import PeerProc  # noqa: E402

KiB = 1 << 10


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def stop(pid: int) -> None:
    """SIGSTOPs `pid` and waits until every thread of it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)


def drain(q: mc.CompletionQueue, n: int, limit_s: float = 20.0) -> list[mc.BatchCompletion]:
    got: list[mc.BatchCompletion] = []
    end = time.monotonic() + limit_s
    while len(got) < n and time.monotonic() < end:
        got += q.wait(0.5)
    return got


@pytest.mark.parametrize("transports", [["local"], ["tcp"]])
def test_queue_reports_every_batch_once_with_its_bytes_and_times(transports):
    reg = mc.TransferRegistry()
    kw = dict(transports=transports, registry=reg)
    with mc.TransferEngine("qa", **kw) as a, mc.TransferEngine("qb", **kw) as b:
        src, dst = a.allocate(4 << 20), b.allocate(4 << 20)
        data = rand(src.length, 1)
        np.asarray(src)[:] = data
        p = a.connect("qb") if transports == ["local"] else a.connect("qb", b.address)
        assert p.transport == transports[0]
        q = mc.CompletionQueue()
        assert q.poll() == [] and q.pending == 0 and len(q) == 0
        sizes = [1, 4 * KiB, 16 * KiB, 100_000, 1 << 20]
        t0 = time.monotonic_ns()
        off, want = 0, {}
        batches = {}
        for tag, n in enumerate(sizes, start=10):
            reqs = [mc.TransferRequest("write", src, off, p, dst.id, off, n)]
            batches[tag] = a.submit(reqs, queue=q, tag=tag)
            want[tag] = n
            off += n
        got = drain(q, len(sizes))
        assert sorted(c.tag for c in got) == sorted(want)
        assert q.poll() == [] and q.pending == 0
        for c in got:
            assert c.ok and c.error is None and c.code is None and c.failed == 0 and c.requests == 1
            assert c.bytes == c.requested_bytes == want[c.tag]
            assert t0 <= c.submitted_ns <= c.finished_ns <= time.monotonic_ns()
            b_ = batches[c.tag]
            assert (b_.submitted_ns, b_.finished_ns, b_.bytes, b_.requested_bytes) == (
                c.submitted_ns, c.finished_ns, c.bytes, c.requested_bytes)
            assert [s.ok for s in c.batch.status()] == [True]
            c.raise_for_error()
        assert bytes(memoryview(dst)[:off]) == data[:off].tobytes()
        s = a.stats()
        assert s.bytes_written == sum(sizes) and s.bytes_read == 0
        assert s.batches == s.batches_done == len(sizes) and s.batches_in_flight == 0
        assert s.requests_failed == 0 and s.busy_s > 0
        # Reads count as reads; a batch without a queue is counted by the engine too.
        back = a.register(bytearray(off))
        assert all(st.ok for st in a.submit([mc.TransferRequest("read", back, 0, p, dst.id, 0, off)]).wait())
        s = a.stats()
        assert (s.bytes_read, s.batches) == (off, len(sizes) + 1)


def test_failures_surface_on_their_own_tag():
    reg = mc.TransferRegistry()
    with mc.TransferEngine("fa", registry=reg, transports=["local"]) as a, \
            mc.TransferEngine("fb", registry=reg, transports=["local"]) as b:
        src, dst = a.allocate(64 * KiB), b.allocate(64 * KiB)
        p = a.connect("fb")
        q = mc.CompletionQueue()
        a.submit([mc.TransferRequest("write", src, 0, p, dst.id, 0, 100)], queue=q, tag=1)
        a.submit([mc.TransferRequest("write", src, 0, p, dst.id, 0, 100),
                  mc.TransferRequest("write", src, 0, p, dst.id, 64 * KiB - 10, 100)], queue=q, tag=2)
        a.submit([mc.TransferRequest("read", src, 0, p, 4242, 0, 100)], queue=q, tag=3)
        a.submit([], queue=q, tag=4)
        got = {c.tag: c for c in drain(q, 4)}
        assert got[1].ok and got[4].ok and got[4].requests == 0
        assert (got[2].ok, got[2].failed, got[2].code, got[2].bytes) == (False, 1, "out_of_bounds", 100)
        assert got[3].code == "no_such_region" and "4242" in got[3].error
        with pytest.raises(mc.TransferFailed):
            got[3].raise_for_error()
        s = a.stats()
        assert (s.requests_failed, s.bytes_written) == (2, 200)
        with pytest.raises(TypeError):
            a.submit([], queue="not a queue", tag=1)  # type: ignore[arg-type]


def test_timeout_of_a_stopped_peer_surfaces_on_its_tag():
    peer = PeerProc(name="stopped", regions=[{"name": "r", "length": 1 << 20}], transports=["tcp"])
    try:
        with mc.TransferEngine("ta", transports=["tcp"], registry=mc.TransferRegistry()) as a:
            p = a.connect("stopped", peer.address)
            mine = a.allocate(1 << 20)
            rid = peer.regions["r"]
            q = mc.CompletionQueue()
            a.submit([mc.TransferRequest("read", mine, 0, p, rid, 0, 4096)], queue=q, tag=1)
            assert drain(q, 1)[0].ok
            stop(peer.proc.pid)
            try:
                a.submit([mc.TransferRequest("read", mine, 0, p, rid, 0, 4096)], timeout_s=0.3, queue=q, tag=2)
                got = drain(q, 1, limit_s=10)
                assert [(c.tag, c.code) for c in got] == [(2, "timeout")]
                assert got[0].finished_ns - got[0].submitted_ns >= 300_000_000  # ended at its deadline
                with pytest.raises(mc.TransferTimeout):
                    got[0].raise_for_error()
                assert a.stats().batches_in_flight == 0
            finally:
                os.kill(peer.proc.pid, signal.SIGCONT)
    finally:
        peer.close()


def test_wait_releases_the_gil_and_returns_empty_on_timeout():
    q = mc.CompletionQueue()
    assert q.wait(0.05) == [] and q.wait(0) == [] and q.wait(-1) == []
    with pytest.raises(mc.InvalidArgument):
        q.wait(float("nan"))
    reg = mc.TransferRegistry()
    with mc.TransferEngine("ga", transports=["local"], registry=reg) as a:
        r = a.allocate(4096)
        me = a.connect("ga")

        def later():
            time.sleep(0.05)
            a.submit([mc.TransferRequest("write", r, 0, me, r.id, 2048, 16)], queue=q, tag=9)

        t = threading.Thread(target=later)
        t.start()
        # If wait() held the GIL, the other thread could not submit and this would
        # return [] after 10 s.
        got = q.wait(10.0)
        t.join()
        assert [c.tag for c in got] == [9]


# ---- Transport (serving) --------------------------------------------------------------


def _pair(in_process: bool, **kw):
    reg = mc.TransferRegistry() if in_process else None
    a_mem, b_mem = np.zeros(1 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
    a_mem[:] = rand(a_mem.size, 3)
    b_mem[:] = rand(b_mem.size, 4)
    tok = None if in_process else "tok"
    a = Transport("ta", a_mem, reg, auth_token=tok, **kw)
    b = Transport("tb", b_mem, reg, auth_token=tok)
    return a, b, a_mem, b_mem


def _settle(t: Transport, tag: int) -> None:
    end = time.monotonic() + 20
    while t.pending(tag) and time.monotonic() < end:
        t.wait(0.05)
    assert t.pending(tag) == 0


@pytest.mark.parametrize("in_process", [True, False])
def test_transport_write_read_and_counters_without_a_waiter_thread(in_process):
    threads = threading.active_count()
    a, b, a_mem, b_mem = _pair(in_process)
    try:
        assert threading.active_count() == threads, "no Python thread per Transport"
        ref_a, ref_b = a_mem.copy(), b_mem.copy()
        writes = [Span(0, 4096, 1000), Span(8192, 100_000, 50_000)]
        a.write(1, b.endpoint, writes)
        a.write(1, b.endpoint, [Span(300_000, 200_000, 4096)])
        a.write(1, b.endpoint, [])
        reads = [Span(500_000, 600_000, 70_000)]
        a.read(2, b.endpoint, reads)
        # at most the two non-empty writes and the one read are outstanding (an empty
        # write submits nothing, so it must not be counted)
        assert a.pending(1) <= 2 and a.pending(2) <= 1
        a.read(3, b.endpoint, [Span(700_000, 0, 10)])
        _settle(a, 1)
        _settle(a, 2)
        _settle(a, 3)
        for s in writes + [Span(300_000, 200_000, 4096)]:
            ref_b[s.remote_off:s.remote_off + s.length] = ref_a[s.local_off:s.local_off + s.length]
        for s in reads + [Span(700_000, 0, 10)]:
            ref_a[s.local_off:s.local_off + s.length] = ref_b[s.remote_off:s.remote_off + s.length]
        assert np.array_equal(b_mem, ref_b) and np.array_equal(a_mem, ref_a)
        assert a.error(1) is None and a.error(2) is None
        assert a.take_bytes(1) == 1000 + 50_000 + 4096 and a.take_bytes(1) == 0
        assert a.take_bytes(2) == 70_000 and a.take_bytes(3) == 10
        assert a.total_bytes == 1000 + 50_000 + 4096 + 70_000 + 10
        assert a.busy_s > 0
        # every batch ended: nothing queued on either side of the instance's link
        assert a.link_queued() == (0.0, 0.0)
    finally:
        a.close()
        b.close()


def test_transport_errors_and_timeouts_land_on_the_right_tag(monkeypatch):
    a, b, _, _ = _pair(True)
    try:
        a.write(5, b.endpoint, [Span(0, (1 << 20) - 10, 100)])  # past the end of b's arena
        a.write(6, b.endpoint, [Span(0, 0, 100)])
        _settle(a, 5)
        _settle(a, 6)
        assert "range outside the region" in (a.error(5) or "")
        assert a.error(5) is None, "an error is reported once"
        assert a.error(6) is None and a.take_bytes(6) == 100
        a.read(7, b.endpoint, [Span(0, 1 << 21, 10)])  # past the end of b's arena
        _settle(a, 7)
        assert "range outside the region" in (a.error(7) or "")
    finally:
        a.close()
        b.close()
    # A stopped peer: the batch deadline ends the write, on its tag only.
    monkeypatch.setattr(tp, "BATCH_TIMEOUT_S", 0.3)
    peer = PeerProc(name="stuck", regions=[{"name": "r", "length": 1 << 20}], transports=["tcp"],
                    auth_token="tok")
    mem = np.zeros(1 << 20, dtype=np.uint8)
    t = Transport("tc", mem, None, auth_token="tok")
    ep = {"name": "stuck", "address": peer.address, "region": peer.regions["r"]}
    try:
        t.write(8, ep, [Span(0, 0, 4096)])
        _settle(t, 8)
        assert t.error(8) is None
        stop(peer.proc.pid)
        try:
            t.write(9, ep, [Span(0, 0, 4096)])
            # the heartbeat's link counters: the stuck write is queued on the NIC out
            assert t.link_queued() == (4096.0, 0.0)
            _settle(t, 9)
            assert t.link_queued() == (0.0, 0.0)  # a batch that failed is no longer queued
            assert "timed out" in (t.error(9) or "")
            assert t.error(8) is None and t.take_bytes(9) == 0
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
    finally:
        t.close()
        peer.close()


def test_transport_link_emulation_holds_batches_until_the_link_is_free():
    a, b, a_mem, b_mem = _pair(True, link_bandwidth=10e6)
    try:
        a.write(1, b.endpoint, [Span(0, 0, 200_000)])  # 20 ms on the emulated link
        a.write(2, b.endpoint, [Span(0, 200_000, 200_000)])
        _settle(a, 1)
        _settle(a, 2)
        assert np.array_equal(b_mem[:400_000], np.concatenate([a_mem[:200_000], a_mem[:200_000]]))
        assert a.take_bytes(1) == a.take_bytes(2) == 200_000
        assert a.busy_s > 0
    finally:
        a.close()
        b.close()


def test_transport_link_counters_with_an_emulated_link():
    # 1 MB/s: two 200 kB writes hold the link out 0.4 s, a 100 kB read the holder's 0.1 s
    a, b, _, _ = _pair(True, link_bandwidth=1e6)
    try:
        a.write(1, b.endpoint, [Span(0, 0, 200_000)])
        a.write(2, b.endpoint, [Span(0, 200_000, 200_000)])
        a.read(3, b.endpoint, [Span(500_000, 600_000, 100_000)])
        out, inn = a.link_queued()
        assert 0 < out <= 400_000 and 0 < inn <= 100_000, (out, inn)
        for tag in (1, 2, 3):
            _settle(a, tag)
        assert a.link_queued() == (0.0, 0.0)
    finally:
        a.close()
        b.close()


def test_wait_without_limit_returns_when_nothing_is_pending_and_inline_send_is_validated():
    assert mc.CompletionQueue().wait() == []  # nothing in flight: would otherwise never return
    with pytest.raises(mc.InvalidArgument, match="inline_send_bytes"):
        mc.TransferEngine("bad-inline", listen="", inline_send_bytes=2 << 20)
    # inline_send_bytes=0: every frame goes through the sender thread; same bytes land.
    reg = mc.TransferRegistry()
    for inline in (0, 16384):
        with mc.TransferEngine("ia", transports=["tcp"], registry=reg, inline_send_bytes=inline) as a, \
                mc.TransferEngine("ib", transports=["tcp"], registry=reg) as b:
            src, dst = a.allocate(1 << 16), b.allocate(1 << 16)
            np.asarray(src)[:] = rand(src.length, 7)
            p = a.connect("ib", b.address)
            q = mc.CompletionQueue()
            for i in range(16):
                a.submit([mc.TransferRequest("write", src, i * 4096, p, dst.id, i * 4096, 4096)], queue=q, tag=i)
            got = drain(q, 16)
            assert sorted(c.tag for c in got) == list(range(16)) and all(c.ok for c in got)
            assert bytes(memoryview(dst)) == bytes(memoryview(src))
            assert mc.CompletionQueue().wait(None) == []
