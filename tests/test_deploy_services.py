"""``mooncake-rs serve --etcd ... --model DIR`` serves the OpenAI API over the workers in
etcd, and ``mooncake-rs worker --kv-events tcp://...`` publishes its store events in
vLLM's ZMQ format while it serves: processes started as a user would, on loopback."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

import text_helpers as th  # noqa: E402
from deploy_helpers import TOKEN, Deployment, LoopbackHosts, wait_until  # noqa: E402
from etcd_helpers import etcd  # noqa: E402,F401,F811  (the fixture)
from ports import free_port, free_port_pair  # noqa: E402

from mooncake_rs import BlockIndex, PrefixHasher  # noqa: E402
from mooncake_rs.kv_events import Ingestor, KVEventSubscriber  # noqa: E402
from mooncake_rs.kv_events.targets import TierTarget  # noqa: E402


pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_the_http_front_and_kv_events_of_a_deployment(etcd, tmp_path: Path) -> None:  # noqa: F811
    model = th.write_model_dir(tmp_path / "model")
    http_port, events_port = free_port(), free_port_pair()
    with LoopbackHosts(3) as hosts:
        dep = Deployment(hosts, etcd, tmp_path)
        try:
            dep.serve("serve", 0, extra=["--model", str(model), "--host", "127.0.0.1", "--port", str(http_port)])
            dep.worker("p0", 1, "prefill", model=str(model),
                       extra=["--kv-events", f"tcp://127.0.0.1:{events_port}"])
            dep.worker("d0", 2, "decode", model=str(model))
            assert dep.wait_log("serve", "OpenAI API on", 60), dep.log_tail()
            base = f"http://127.0.0.1:{http_port}"
            assert wait_until(lambda: _get(base + "/health")[0] == 200, 90), dep.log_tail()
            # A ZMQ PUB drops what it sends before a subscription has reached it (the
            # "slow joiner"), and nothing tells the SUB when its subscription arrived: a
            # request served before then publishes its only batch to nobody, and with no
            # later message the subscriber never learns it missed one. So probe: publish
            # (a request of its own blocks) until the subscriber has seen a message; its
            # catch-up replays from the worker's buffer whatever went out before.
            mine = BlockIndex()
            sub = KVEventSubscriber(f"tcp://127.0.0.1:{events_port}",
                                    Ingestor(TierTarget(mine), 0, PrefixHasher(16, seed=0)),
                                    replay_endpoint=f"tcp://127.0.0.1:{events_port + 1}")
            sub.start()
            try:
                requests = 0
                for probe in range(20):
                    _complete(base, f"probe {probe}: " + "the quick brown fox jumps " * 4, 1)
                    requests += 1
                    if wait_until(lambda: sub.last_seq is not None, 3):  # applied, catch-up included
                        break
                assert sub.last_seq is not None, (sub.stats, dep.log_tail())
                before = mine.stats().blocks
                out = _complete(base, "hello world, hello mooncake, hello cluster " * 3, 4)
                requests += 1
                assert out["usage"]["completion_tokens"] == 4, out
                prompt_tokens = out["usage"]["prompt_tokens"]
                assert prompt_tokens >= 16
                # the prefill worker published the prompt's full blocks, with their tokens
                assert wait_until(lambda: mine.stats().blocks >= before + prompt_tokens // 16, 30), \
                    (sub.stats, mine.stats(), dep.log_tail())
                assert f"mooncake_requests_finished_total {requests}" in _get(base + "/metrics")[1]
            finally:
                sub.stop()
        finally:
            dep.close()
    assert all(p.poll() is not None for p in dep.procs.values())
    assert TOKEN not in dep.logs["serve"].read_text()  # the token never reaches a log


def _complete(base: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError as e:
        return getattr(e, "code", 0) or 0, ""
