"""The front's 429 (the conductor rejects), a stream whose instance dies, and 503 (no
instance can serve), on one cluster of worker processes: its conductor rejects long
prompts (a 10 ms TTFT SLO under early rejection: its cost model puts a ~1000-token
prefill above it, a short one below), and its decode worker is killed mid-stream."""

from __future__ import annotations

import json
import os
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from http_helpers import MODEL, metric, start_front, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LONG = "hello world " * 500


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster, front, server, d = start_front(tmp_path_factory, api_key=None, prefill=1, decode=1, processes=True,
                                            rejection="early", ttft_slo_s=0.01)
    yield cluster, front, server
    server.stop()
    cluster.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_429_with_retry_after(served, client, stream):
    before = httpx.get(served[2].url + "/metrics").text
    with pytest.raises(openai.RateLimitError) as ei:
        r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=4, stream=stream)
        list(r) if stream else None
    resp = ei.value.response
    assert int(resp.headers["retry-after"]) >= 1
    err = resp.json()["error"]
    assert err["code"] == "ttft_slo" and "ttft_slo" in err["message"] and "Retry-After" in err["message"]
    after = httpx.get(served[2].url + "/metrics").text
    assert metric(after, "mooncake_requests_rejected_total") == metric(before, "mooncake_requests_rejected_total") + 1
    assert metric(after, "mooncake_front_rejected_total") == metric(before, "mooncake_front_rejected_total") + 1


def test_short_prompts_are_served(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_instance_dying_mid_stream_ends_it_with_an_error_event(served):
    cluster, _, server = served
    decode = next(i for i, name in cluster.instances().items() if name.startswith("decode"))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: "))
        os.kill(cluster.pid_of(decode), signal.SIGKILL)
        rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "instance_failed" and "decode-0" in err["message"]


def test_no_instance_is_503(served, client):
    cluster, _, server = served
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, 60, "/health to answer 503")
    assert "0 decode" in httpx.get(server.url + "/health").json()["detail"]
    with pytest.raises(openai.InternalServerError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ei.value.response.status_code == 503
    assert ei.value.response.json()["error"]["code"] == "no_instance"
