"""Issue 26, item 1: one request never kills an instance.

Every sampling field is bounded where it enters (``SamplingParams``, the HTTP schema, the
wire, where ``SamplingParams`` itself is decoded and validated), and an exception while serving one request fails
that request only: the engine's step (forward, sampling) and the instance loop go on.
The hypothesis fuzzers throw every field and type at a live cluster and at the HTTP
front over it and check that both keep serving.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mooncake_rs.errors import InvalidArgument, MooncakeError  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def _sp(**kw):
    from mooncake_rs.engine import SamplingParams

    return SamplingParams(**kw)


@pytest.fixture(scope="module")
def cluster():
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig

    # one prefill instance: if it died, every later request would be refused
    c = Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, seed=0)
    yield c
    c.close()


def _serves(cluster) -> None:
    """The cluster still has both instances and still answers a greedy request exactly."""
    from mooncake_rs.engine import Engine, ModelConfig

    assert sorted(cluster.instance_roles().values()) == ["decode", "prefill"]
    p = _sp(max_tokens=4)
    out = cluster.generate([PROMPT], p)[0]
    ref = Engine(ModelConfig.tiny(), block_size=16, seed=0).generate([PROMPT], p)[0]
    assert out.token_ids == ref.token_ids


# ---- bounds where the fields enter
@pytest.mark.parametrize("kw, field", [
    (dict(top_k=2 ** 63), "top_k"), (dict(top_k=2 ** 31), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_k=1.5), "top_k"), (dict(max_tokens=2 ** 63), "max_tokens"), (dict(max_tokens="8"), "max_tokens"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=1e-30), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(temperature=1e9), "temperature"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p="0.5"), "top_p"), (dict(top_p=True), "top_p"),
    (dict(seed=2 ** 64), "seed"), (dict(seed=1.0), "seed"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop_token_ids=(2 ** 63,)), "stop_token_ids"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(5000))), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
])
def test_sampling_params_refuse_out_of_range_values(kw, field):
    with pytest.raises(InvalidArgument, match=field):
        _sp(**kw)


def test_top_k_past_int64_is_refused_and_the_instance_keeps_serving(cluster):
    """The issue's reproduction: top_k >= 2**63 overflowed torch.tensor in the instance
    loop, the only prefill instance was reported dead and every later request was 503."""
    with pytest.raises(InvalidArgument, match="top_k"):
        cluster.generate([PROMPT], _sp(max_tokens=4, temperature=1.0, top_k=2 ** 63))
    _serves(cluster)


def test_a_value_that_bypassed_the_client_check_fails_only_its_request(cluster):
    """A ``SamplingParams`` forced past its checks: the cluster checks it again where the
    request enters (``SamplingParams.checked``; on the wire it is the frame's type, checked
    on decode), so the request fails typed and the instance lives."""
    p = _sp(max_tokens=4, temperature=1.0)
    object.__setattr__(p, "top_k", 2 ** 63)
    with pytest.raises(MooncakeError, match="top_k"):
        cluster.generate([PROMPT], p)
    _serves(cluster)


def test_the_sampler_clamps_top_k_to_the_vocabulary():
    import torch

    from mooncake_rs.engine.sampler import Sampler

    p = _sp(max_tokens=1, temperature=1.0, top_k=5, seed=3)
    object.__setattr__(p, "top_k", 2 ** 63)  # past int64: must not overflow the tensor
    logits = torch.randn(2, 50)
    ref = Sampler(0).sample(logits, [_sp(max_tokens=1, temperature=1.0, seed=3)] * 2, [0, 1])
    assert Sampler(0).sample(logits, [p, p], [0, 1]) == ref


# ---- an exception while serving one request fails that request only
def _poison_sampler(monkeypatch, seed: int) -> None:
    from mooncake_rs.engine.sampler import Sampler

    real = Sampler.sample

    def sample(self, logits, params, indices):
        if any(p.seed == seed for p in params):
            raise RuntimeError("poisoned row")
        return real(self, logits, params, indices)

    monkeypatch.setattr(Sampler, "sample", sample)


def test_engine_step_fails_the_request_whose_sampling_raises_and_serves_the_rest(monkeypatch):
    from mooncake_rs.engine import Engine, ModelConfig

    ref = Engine(ModelConfig.tiny(), block_size=16, seed=0).generate([PROMPT, PROMPT[:7]], _sp(max_tokens=6))
    _poison_sampler(monkeypatch, 777)
    eng = Engine(ModelConfig.tiny(), block_size=16, seed=0)
    good = [eng.add_request(PROMPT, _sp(max_tokens=6)), eng.add_request(PROMPT[:7], _sp(max_tokens=6))]
    bad = eng.add_request(PROMPT[:11], _sp(max_tokens=6, temperature=1.0, seed=777))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[bad].finish_reason == "abort" and "poisoned row" in done[bad].error
    assert [done[g].token_ids for g in good] == [r.token_ids for r in ref]
    assert all(done[g].error is None for g in good)
    assert eng.num_free_pages == eng.cache.num_pages  # the failed request's pages came back


def test_engine_forward_failure_fails_its_batch_and_the_engine_goes_on(monkeypatch):
    from mooncake_rs.engine import Engine, ModelConfig

    eng = Engine(ModelConfig.tiny(), block_size=16, seed=0)
    real = eng.model.forward
    calls = {"n": 0}

    def forward(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fault")
        return real(*a, **kw)

    monkeypatch.setattr(eng.model, "forward", forward)
    rid = eng.add_request(PROMPT, _sp(max_tokens=3))
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")] and "device fault" in outs[0].error
    assert eng.num_free_pages == eng.cache.num_pages
    assert eng.generate([PROMPT], _sp(max_tokens=3))[0].finish_reason == "length"


def test_a_request_failing_in_the_engine_step_fails_alone_on_a_live_cluster(cluster, monkeypatch):
    """In-process instances run in this process: the poisoned sampler is theirs too."""
    _poison_sampler(monkeypatch, 4242)
    hs = [cluster.submit(PROMPT, _sp(max_tokens=5)) for _ in range(3)]
    bad = cluster.submit(PROMPT[:9], _sp(max_tokens=5, temperature=1.0, seed=4242))
    hs += [cluster.submit(PROMPT[:13], _sp(max_tokens=5))]
    with pytest.raises(MooncakeError, match="poisoned row"):
        bad.result(60)
    for h in hs:
        assert h.result(60).finish_reason == "length"
    monkeypatch.undo()
    _serves(cluster)


def test_an_exception_in_the_instance_loop_fails_its_requests_not_the_instance(cluster, monkeypatch):
    from mooncake_rs.serving.decode import DecodeRole

    real = DecodeRole.poll
    fired = {"n": 0}

    def poll(self):
        if self.active and not fired["n"]:
            fired["n"] += 1
            raise RuntimeError("a bug in the loop")
        return real(self)

    monkeypatch.setattr(DecodeRole, "poll", poll)
    h = cluster.submit(PROMPT, _sp(max_tokens=200, ignore_eos=True))
    with pytest.raises(MooncakeError, match="a bug in the loop"):
        h.result(60)
    assert fired["n"] == 1
    monkeypatch.undo()
    _serves(cluster)
    st = cluster.instance_stats()
    assert all(s["requests"] == 0 and s["pinned_requests"] == 0 for s in st.values())


# ---- fuzzing a live cluster and the HTTP front over it
_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=8),
    st.lists(st.integers(-5, 2 ** 65), max_size=4), st.binary(max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_SMALL_MAX = st.one_of(st.integers(1, 8), _ANY)
_FIELDS = ("temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(max_tokens=_SMALL_MAX, values=st.fixed_dictionaries({}, optional={f: _ANY for f in _FIELDS}))
def test_fuzz_sampling_params_against_a_live_cluster(cluster, max_tokens, values):
    try:
        p = _sp(max_tokens=max_tokens, **values)
    except InvalidArgument:
        return
    except TypeError as e:  # a wrong type must be InvalidArgument, never a bare TypeError
        pytest.fail(f"TypeError for {values!r}: {e}")
    if p.max_tokens > 8:
        p = _sp(**{**p.__dict__, "max_tokens": 8})
    out = cluster.generate([PROMPT], p)[0]
    assert 1 <= len(out.token_ids) <= 8
    assert sorted(cluster.instance_roles().values()) == ["decode", "prefill"]


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    import text_helpers as th

    from mooncake_rs import Cluster
    from mooncake_rs.http import Frontend, ServerThread

    d = th.write_model_dir(tmp_path_factory.mktemp("models") / "fuzz", max_position_embeddings=96)
    c = Cluster(str(d), prefill=1, decode=1, seed=0)
    try:
        f = Frontend.from_model_dir(c, d, model_name="m")
        server = ServerThread(f).start()
    except BaseException:
        c.close()
        raise
    yield c, server
    server.stop()
    c.close()


# JSON values of every type (NaN and infinities included: Python's json reads them)
_JANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=8),
    st.lists(st.integers(-5, 2 ** 65), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_BODY_FIELDS = {name: _JANY for name in (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "ignore_eos", "stream", "stream_options", "n", "best_of", "presence_penalty", "frequency_penalty",
    "logprobs", "response_format", "add_generation_prompt", "user")}
_JSONABLE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                                   st.floats(allow_nan=False), st.text(max_size=6)),
                         lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                 st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                         max_leaves=8)


def _encode(body) -> bytes:
    # json.dumps writes NaN/Infinity (Python's json reads them back): the server must refuse them
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(chat=st.booleans(), fields=st.fixed_dictionaries({}, optional=_BODY_FIELDS),
       prompt=st.one_of(st.text(max_size=12), st.lists(st.integers(-3, 2 ** 64), max_size=4), _JSONABLE,
                        st.just("\ud800 lone"), st.just([[1, 2]])),
       messages=st.one_of(st.just([{"role": "user", "content": "hi"}]), _JSONABLE,
                          st.just([{"role": "user", "content": "\udfff"}]),
                          st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                          "content": _JSONABLE}), max_size=2)))
def test_fuzz_the_http_schema_against_a_live_front(front, chat, fields, prompt, messages):
    import httpx

    cluster, server = front
    body = {"model": "m", **fields}
    body["messages" if chat else "prompt"] = messages if chat else prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(server.url + path, content=_encode(body), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code in (200, 400), (r.status_code, r.text, body)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"]
    assert sorted(cluster.instance_roles().values()) == ["decode", "prefill"]


def test_the_front_still_serves_after_the_fuzz(front):
    import httpx

    cluster, server = front
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3,
                                                          "top_k": 2 ** 63 - 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 3,
                                                          "temperature": 1.0, "top_k": 2 ** 31 - 1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert math.isfinite(r.elapsed.total_seconds())
