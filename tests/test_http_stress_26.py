"""Issue 26, item 8: the HTTP front under stress.

Slow connections are closed (a deadline for the request head, one for the body) and
connections are capped; a client leaving mid-stream or mid-upload is a disconnect, not
a server error (and no "aclose(): asynchronous generator is already running"); streams
are served from the event loop, not a thread each; a shutdown (``ServerThread.stop``,
SIGTERM of ``mooncake-rs serve``) ends running streams with an error event and
``[DONE]`` and closes the cluster before the process exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

import text_helpers as th  # noqa: E402
from http_helpers import metric, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
MODEL = "stress"


def _start(tmp_path_factory, limits):
    from mooncake_rs import Cluster
    from mooncake_rs.http import Frontend, ServerThread

    d = th.write_model_dir(tmp_path_factory.mktemp("models") / MODEL)
    c = Cluster(str(d), prefill=1, decode=1, seed=0)
    try:
        front = Frontend.from_model_dir(c, d, model_name=MODEL, limits=limits)
        server = ServerThread(front).start()
    except BaseException:
        c.close()
        raise
    return c, front, server, d


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from mooncake_rs.http import FrontLimits

    c, front, server, d = _start(tmp_path_factory, FrontLimits(header_timeout_s=0.5, body_timeout_s=0.5,
                                                               max_connections=24))
    yield c, front, server
    server.stop()
    c.close()


def _connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``s`` within ``seconds``; None if still open."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        return got


def _ok(server) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      timeout=30)


def test_slow_headers_are_closed_and_connections_capped(served):
    _, _, server = served
    slow = []
    for _ in range(40):
        s = _connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
        slow.append(s)
    # past the cap: a 503 in the OpenAI shape, closed at once
    over = [_closed_within(s, 0.3) for s in slow[24:]]
    assert all(o is not None and b" 503 " in o.split(b"\r\n")[0] and b"too_many_connections" in o for o in over)
    # under it: closed once the head deadline passed
    assert all(_closed_within(s, 5.0) is not None for s in slow[:24])
    for s in slow:
        s.close()
    assert _ok(server).status_code == 200


def test_a_kept_alive_connection_must_send_its_next_head_in_time(served):
    _, _, server = served
    s = _connect(server)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    s.settimeout(30)
    assert b" 200 " in s.recv(65536).split(b"\r\n")[0]
    t0 = time.monotonic()
    try:
        for _ in range(40):  # a byte at a time, each within uvicorn's keep-alive, never a full head
            s.sendall(b"X")
            time.sleep(0.15)
    except OSError:  # closed by the server (the head deadline)
        pass
    assert _closed_within(s, 5.0) is not None
    assert time.monotonic() - t0 < 5.0  # not 40 x 0.15 s: the bytes did not keep it open
    s.close()


def test_a_slow_body_is_408_and_an_abandoned_upload_no_500(served):
    _, front, server = served
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\"")
    got = _closed_within(s, 10.0) or b""
    s.close()
    assert b" 408 " in got.split(b"\r\n")[0] and b"body_timeout" in got
    before = front.metrics.totals["disconnects"]
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\"")
    time.sleep(0.1)
    s.close()
    wait_for(lambda: front.metrics.totals["disconnects"] > before, 10, "the disconnect counted")
    assert not any(status == 500 for (_route, status) in front.metrics.responses)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += " " + logging.Formatter().formatException(record.exc_info)
        self.messages.append(text)


def test_clients_leaving_mid_stream_log_no_error_and_free_their_requests(served):
    cluster, front, server = served
    rec = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "mooncake_rs.http", "asyncio")]
    for lg in loggers:
        lg.addHandler(rec)
    try:
        before = front.metrics.totals["disconnects"]
        for _ in range(6):
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "go", "max_tokens": 2000, "ignore_eos": True,
                                    "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
            # leaving the block closes the connection mid-stream
        wait_for(lambda: front.metrics.totals["disconnects"] >= before + 6, 20, "six disconnects")
        wait_for(lambda: front.active_requests == 0, 20, "the requests to end")
        wait_for(lambda: all(s["requests"] == 0 for s in cluster.instance_stats().values()), 20,
                 "the instances to drop them")
    finally:
        for lg in loggers:
            lg.removeHandler(rec)
    assert not [m for m in rec.messages if "already running" in m or "Exception in ASGI" in m], rec.messages


def test_streams_are_served_without_a_thread_each(served):
    _, front, server = served
    base = threading.active_count()
    peak = [base]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            time.sleep(0.01)

    import asyncio

    async def streams(n):
        async with httpx.AsyncClient(timeout=60) as client:
            async def one():
                async with client.stream("POST", server.url + "/v1/completions",
                                         json={"model": MODEL, "prompt": "s", "max_tokens": 64, "ignore_eos": True,
                                               "stream": True}) as r:
                    return [line async for line in r.aiter_lines() if line]
            return await asyncio.gather(*[one() for _ in range(n)])

    w = threading.Thread(target=watch)
    w.start()
    try:
        outs = asyncio.run(streams(16))
    finally:
        done.set()
        w.join()
    assert all(o[-1] == "data: [DONE]" for o in outs)
    assert peak[0] - base < 8, f"{peak[0] - base} threads for 16 streams"


def test_server_stop_ends_running_streams_with_an_error_event_and_done(tmp_path_factory):
    from mooncake_rs.http import FrontLimits

    c, front, server, _ = _start(tmp_path_factory, FrontLimits())
    results: list[list[str]] = []

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True,
                                "stream": True}) as r:
            results.append([line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=stream) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: front.active_requests == 4, 30, "four running streams")
        time.sleep(0.3)
        server.stop()
        for t in threads:
            t.join(30)
    finally:
        c.close()
    assert len(results) == 4
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["code"] == "unavailable" and "shutting down" in err["error"]["message"]


def test_sigterm_drains_streams_and_closes_the_cluster_before_exit(tmp_path_factory):
    d = th.write_model_dir(tmp_path_factory.mktemp("models") / MODEL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = "import sys; from mooncake_rs.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", cli, "serve", "--model", str(d), "--port", str(port),
                             "--prefill", "1", "--decode", "1", "--processes"], stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(url), 180, "the server to start")
        results: list[list[str]] = []

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True,
                                    "stream": True}) as r:
                results.append([line for line in r.iter_lines() if line])

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: metric(httpx.get(url + "/metrics").text, "mooncake_front_active_streams") == 3, 60,
                 "three running streams")
        workers = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert rc == 0, err  # not killed by the re-raised signal
    assert "requests drained, cluster closed" in err
    assert len(results) == 3
    for lines in results:
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    # the cluster was closed: its worker processes are gone
    assert all(not os.path.exists(f"/proc/{pid}") for pid in workers)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]
