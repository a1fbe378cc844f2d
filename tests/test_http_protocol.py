"""Request-body checks of the OpenAI front (no server): what is accepted, what is a 400
naming the field."""

from __future__ import annotations

import pytest

from mooncake_rs.http import ApiError, parse_chat, parse_completion

BASE = {"model": "m", "prompt": "hi"}


def test_defaults_and_aliases():
    r = parse_completion(BASE)
    assert (r.prompt, r.max_tokens, r.temperature, r.top_k, r.stream) == ("hi", None, 1.0, -1, False)
    assert parse_completion({**BASE, "prompt": [[1, 2, 3]]}).prompt_ids == [1, 2, 3]
    assert parse_completion({**BASE, "prompt": ["x"]}).prompt == "x"
    c = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7})
    assert c.max_tokens == 7 and c.add_generation_prompt
    r = parse_completion({**BASE, "stop": ["a", 5], "stop_token_ids": [7], "top_k": 0, "top_p": 0})
    assert (r.stop, r.stop_token_ids, r.top_k) == (["a"], [5, 7], -1) and 0 < r.top_p < 1e-6
    # what clients send by default with neutral values is accepted
    parse_completion({**BASE, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None,
                      "best_of": 1, "echo": False, "user": "u"})
    r = parse_completion({**BASE, "stream": True, "stream_options": {"include_usage": True}})
    assert r.stream and r.include_usage


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"n": 3}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"tools": [{}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"model": ""}, "model"),
])
def test_bad_fields_are_400_naming_the_field(extra, param):
    with pytest.raises(ApiError) as ei:
        parse_completion({**BASE, **extra})
    assert ei.value.status == 400 and ei.value.param == param
    assert ei.value.body()["error"]["param"] == param


def test_bad_bodies():
    for body in ([], "x", None):
        with pytest.raises(ApiError):
            parse_completion(body)
    with pytest.raises(ApiError) as ei:
        parse_chat({"model": "m", "messages": []})
    assert ei.value.param == "messages"
