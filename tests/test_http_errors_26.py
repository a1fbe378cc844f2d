"""Issue 26, item 6: bodies no tokenizer can take are 400 (not 500), and unknown routes or
methods answer in the OpenAI error shape (JSON), like every other error of the front."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from http_helpers import API_KEY, MODEL, start_front  # noqa: E402

pytestmark = pytest.mark.timeout(240)
AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster, front, server, d = start_front(tmp_path_factory, prefill=1, decode=1)
    yield cluster, front, server
    server.stop()
    cluster.close()


def _post(server, path, raw: bytes):
    return httpx.post(server.url + path, content=raw, headers=AUTH, timeout=60)


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"model": "%s", "prompt": "a \\ud800 b", "max_tokens": 2}' % MODEL.encode(), "prompt"),
    ("/v1/completions", b'{"model": "%s", "prompt": ["\\udfff"], "max_tokens": 2}' % MODEL.encode(), "prompt"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
     % MODEL.encode(), "messages"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "x\\udbff"}]}]}' % MODEL.encode(), "messages"),
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "stop": ["\\ud800"]}' % MODEL.encode(), "stop"),
])
def test_a_lone_surrogate_is_400_naming_the_field(served, path, raw, param):
    r = _post(served[2], path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_400(served, depth):
    raw = b'{"model": "%s", "prompt": "hi", "user": ' % MODEL.encode() + b"[" * depth + b"]" * depth + b"}"
    r = _post(served[2], "/v1/completions", raw)
    assert r.status_code == 400, r.text
    assert "deeper than" in r.json()["error"]["message"]


def test_unknown_route_is_a_json_404(served):
    r = httpx.get(served[2].url + "/v1/nope", headers=AUTH, timeout=30)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "not_found" and "/v1/nope" in err["message"]


def test_wrong_method_is_a_json_405_with_allow(served):
    r = httpx.get(served[2].url + "/v1/completions", headers=AUTH, timeout=30)
    assert r.status_code == 405
    assert r.headers["content-type"].startswith("application/json")
    assert "POST" in r.headers["allow"]
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_the_front_serves_after_the_bad_bodies(served):
    r = httpx.post(served[2].url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
