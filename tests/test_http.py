"""The OpenAI-compatible front against a served tiny model, with the real ``openai`` client
(sync and async, streaming and not). One server for the module; few tokens per request."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from http_helpers import API_KEY, MODEL, metric, start_front, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster, front, server, d = start_front(tmp_path_factory)
    yield cluster, front, server, d
    server.stop()
    cluster.close()


@pytest.fixture(scope="module")
def engine(served):
    from mooncake_rs.engine import Engine

    return Engine(str(served[3]), seed=0, block_size=16)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(served):
    return openai.AsyncOpenAI(base_url=served[2].url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def greedy(engine, ids, n, stop_ids=()):
    from mooncake_rs.engine import SamplingParams

    return engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=tuple(stop_ids)))[0]


def ref_text(front, engine, prompt, n):
    tok = front.tokenizer
    return tok.decode(greedy(engine, tok.encode(prompt), n).token_ids)


def test_completion_matches_the_engine(served, client, engine):
    front = served[1]
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref_text(front, engine, "hello world", 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(front.tokenizer.encode("hello world"))
    assert r.object == "text_completion" and r.model == MODEL


def test_usage_reports_the_reused_prompt_tokens(served, client):
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens whose KV came from a
    # store, which the cluster's own reused-token counter moves by (the reference)
    cluster = served[0]
    prompt = "a cache of keys and values for every block of the prompt, reused " * 3
    before = cluster.metrics.reused_tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == cluster.metrics.reused_tokens - before == 0
    before = cluster.metrics.reused_tokens
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == cluster.metrics.reused_tokens - before
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached  # the same prefix again


def test_completion_stream_equals_non_stream_and_reports_usage(served, client, engine):
    front = served[1]
    chunks = list(client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref_text(front, engine, "the quick brown fox", 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt(served, client, engine):
    ids = served[1].tokenizer.encode("prefill and decode")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == served[1].tokenizer.decode(greedy(engine, ids, 5).token_ids)


def test_chat_sync_and_async_stream(served, client, aclient, engine):
    tok = served[1].tokenizer
    msgs = [{"role": "system", "content": "you are tiny"}, {"role": "user", "content": "grüße 😀"}]
    want = tok.decode(greedy(engine, tok.encode_chat(msgs), 9).token_ids)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(tok.encode_chat(msgs))

    async def stream():
        s = await aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return [c async for c in s]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_completion_non_stream(served, aclient, engine):
    async def one():
        return await aclient.completions.create(model=MODEL, prompt="hello cluster", max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})

    assert asyncio.run(one()).choices[0].text == ref_text(served[1], engine, "hello cluster", 6)


def _spanning_stop(tok, ids):
    """A 3-character stop string of the output that begins in one token's text and ends in
    a later one's, and its first position in the output text."""
    from mooncake_rs.text import IncrementalDetokenizer

    d = IncrementalDetokenizer(tok)
    bounds, text = [], ""
    for t in ids:
        text += d.push([t])
        bounds.append(len(text))
    for b in bounds:
        for a in (b - 1, b - 2):
            s = text[a:a + 3]
            if a > 0 and len(s) == 3 and "\ufffd" not in s and a + 3 > b:
                return s, text
    raise AssertionError(f"no boundary-spanning stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_token_boundaries(served, client, engine, stream):
    tok = served[1].tokenizer
    prompt = "a cache of keys"
    out = greedy(engine, tok.encode(prompt), 40).token_ids
    stop, full = _spanning_stop(tok, out)
    want = full[:full.find(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "never-seen-zzz"],
              extra_body={"ignore_eos": True})
    cm = served[0].metrics
    before = cm.summary()
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < 40  # the request was stopped, not run to the end
    assert (text, reason) == (want, "stop")
    # a stop string ends the request early: cancelled (or finished, if its last token was
    # in before the cancel), never a failure of the cluster's
    wait_for(lambda: cm.cancelled + cm.finished == before["cancelled"] + before["finished"] + 1, 30,
             "the stopped request to end")
    assert cm.failed == before["failed"]


def test_stop_token_ids(served, client, engine):
    tok = served[1].tokenizer
    out = greedy(engine, tok.encode("hello mooncake"), 12).token_ids
    k = next(i for i in range(2, 12) if out[i] not in out[:i])
    r = client.completions.create(model=MODEL, prompt="hello mooncake", max_tokens=12, temperature=0,
                                  stop=None, extra_body={"ignore_eos": True, "stop_token_ids": [out[k]]})
    assert r.choices[0].text == tok.decode(out[:k])  # the stop token itself is not text
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="hello", max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def _error(e):
    body = e.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("kw, param, words", [
    (dict(n=2), "n", "must be 1"),
    (dict(temperature=-1), "temperature", "[0, 2]"),
    (dict(max_tokens=5000), "max_tokens", "context"),
    (dict(model="gpt-4"), "model", "tiny-chat"),
    (dict(extra_body={"top_k": "x"}), "top_k", "integer"),
    (dict(logprobs=2), "logprobs", "not supported"),
    (dict(prompt=[1, 2, 99999]), "prompt", "vocabulary"),
    (dict(prompt="x" * 6000, max_tokens=1), "prompt", "context"),
])
def test_bad_requests_are_400_with_what_to_fix(client, kw, param, words):
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(**args)
    err = _error(ei.value)
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_bad_chat_and_bad_json_are_400(served, client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert "roles are system, user, assistant" in _error(ei.value)["message"]
    r = httpx.post(served[2].url + "/v1/completions", content=b"{nope",
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_api_key_is_required(served):
    bad = openai.OpenAI(base_url=served[2].url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert "API key" in _error(ei.value)["message"]
    r = httpx.get(served[2].url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served[2].url + "/health").status_code == 200  # probes need no key


def test_request_id_is_echoed(served):
    h = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "req-abc-42"}
    r = httpx.post(served[2].url + "/v1/completions", headers=h,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc-42"
    r = httpx.post(served[2].url + "/v1/completions", headers=h, json={"model": MODEL, "prompt": "hi", "n": 3})
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-abc-42"
    assert httpx.get(served[2].url + "/health").headers["x-request-id"]  # one is made up when none is sent


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    # one request of its own, so the counters below do not depend on the tests run before
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    h = httpx.get(served[2].url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(served[2].url + "/metrics").text
    assert metric(text, "mooncake_requests_total") >= 1          # the cluster's
    assert metric(text, "mooncake_instances_alive") == 3
    assert 'mooncake_front_responses_total{route="/v1/completions",status="200"}' in text  # the front's
    assert metric(text, "mooncake_front_ttft_seconds_count") >= 1
    # KV usage from the instances' heartbeats, per instance, without a round trip
    cluster = served[0]
    want = {str(i) for i in cluster.instances()}
    def gauged():
        t = httpx.get(served[2].url + "/metrics").text
        got = {ln.split('"')[1] for ln in t.splitlines() if ln.startswith("mooncake_kv_free_blocks{")}
        return t if got == want else None

    text = wait_for(gauged, 30, "every instance's KV gauge")
    for name in ("mooncake_kv_used_blocks", "mooncake_store_used_blocks", "mooncake_store_slots"):
        assert sum(ln.startswith(name + "{") for ln in text.splitlines()) == len(want), name
    assert metric(text, "mooncake_requests_cancelled_total") == cluster.metrics.cancelled


def test_32_concurrent_streams(served, aclient, engine):
    tok = served[1].tokenizer
    prompts = [f"hello world {i} " + "grüße " * (i % 5) for i in range(32)]
    want = [tok.decode(o.token_ids) for o in engine.generate(
        [tok.encode(p) for p in prompts], __import__("mooncake_rs.engine", fromlist=["SamplingParams"]).SamplingParams(
            max_tokens=6, ignore_eos=True))]

    async def one(p):
        s = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in s])

    async def run_all():
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 180)

    assert asyncio.run(run_all()) == want


def test_disconnect_mid_stream_cancels_the_request(served):
    cluster, front, server, _ = served
    before = httpx.get(server.url + "/metrics").text
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(6)) if ln.startswith("data: ")]
            assert got and json.loads(got[0][6:])["choices"][0]["finish_reason"] is None
        # leaving the block closes the connection mid-stream

    def released():
        t = httpx.get(server.url + "/metrics").text
        return (metric(t, "mooncake_requests_in_flight") == 0 and metric(t, "mooncake_front_active_streams") == 0
                and metric(t, "mooncake_requests_cancelled_total")
                == metric(before, "mooncake_requests_cancelled_total") + 1
                and t)

    after = wait_for(released, 60, "the cancelled request to be released")
    assert metric(after, "mooncake_requests_finished_total") == metric(before, "mooncake_requests_finished_total")
    # a client gone is no failure of the cluster's
    assert metric(after, "mooncake_requests_failed_total") == metric(before, "mooncake_requests_failed_total")
    assert metric(after, "mooncake_front_client_disconnects_total") == \
        metric(before, "mooncake_front_client_disconnects_total") + 1
    # every instance let go of it: no request state, no pinned slots, all pages free
    for stats in cluster.instance_stats().values():
        assert stats["requests"] == 0 and stats["pinned_requests"] == 0
        assert stats["free_pages"] == stats["pages"]


def test_disconnect_before_a_non_streaming_answer_cancels_too(served):
    cluster, _, server, _ = served
    before = httpx.get(server.url + "/metrics").text
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up (closes the connection) before the end
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(60, read=1.0))

    def released():
        t = httpx.get(server.url + "/metrics").text
        return (metric(t, "mooncake_requests_in_flight") == 0
                and metric(t, "mooncake_front_client_disconnects_total")
                == metric(before, "mooncake_front_client_disconnects_total") + 1 and t)

    after = wait_for(released, 60, "the abandoned request to be released")
    assert metric(after, "mooncake_requests_finished_total") == metric(before, "mooncake_requests_finished_total")


def test_oversized_body_is_refused(served, monkeypatch):
    import mooncake_rs.http.app as app_mod

    monkeypatch.setattr(app_mod, "_MAX_BODY", 1000)
    r = httpx.post(served[2].url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": "x" * 2000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
