"""The OpenAI request bodies the front accepts, checked field by field.

``parse_completion`` / ``parse_chat`` turn a decoded JSON body into a
:class:`GenerateRequest` or raise ``ApiError(400)`` naming the field and what to send
instead. Fields a client sends by default with neutral values (``n=1``, penalties 0,
``logprobs`` null, ...) are accepted; the same fields asking for something this server
does not do are refused rather than silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..base.params import MAX_SEED, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, MAX_TOKENS, MAX_TOP_K, MIN_TEMPERATURE
from .errors import bad_request

__all__ = ["GenerateRequest", "parse_completion", "parse_chat", "check_json", "MAX_JSON_DEPTH"]

MAX_STOP_STRINGS = 16
#: how deep objects and arrays may nest in a body (a chat message with content parts is 5)
MAX_JSON_DEPTH = 32


@dataclass
class GenerateRequest:
    """One checked request. Exactly one of ``prompt`` (text), ``prompt_ids`` or
    ``messages`` is set. ``max_tokens`` None: the front picks the default."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    add_generation_prompt: bool = True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {v!r}", name)
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be an integer {rng}, got {v!r}", name)
    return int(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (one choice per request), got {n!r}; send separate requests for more "
                          "choices", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("'best_of' is not supported; leave it out or set it to 1", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0):
            raise bad_request(f"'{name}' is not supported; leave it out or set it to 0", name)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise bad_request("'repetition_penalty' is not supported; leave it out or set it to 1", "repetition_penalty")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported; leave it out", "logit_bias")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "tool_choice",
                 "function_call"):
        v = body.get(name)
        if v not in (None, False, "none") and not (name == "logprobs" and v == 0):
            raise bad_request(f"'{name}' is not supported by this server; leave it out", name)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")


def _stops(body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """``stop``: a string or a list of strings and token ids; ``stop_token_ids``: token ids."""
    v = body.get("stop")
    items: list[Any] = [] if v is None else [v] if isinstance(v, str) else v if isinstance(v, list) else [None]
    strings: list[str] = []
    ids: list[int] = []
    for s in items:
        if isinstance(s, str) and s:
            strings.append(s)
        elif _is_int(s) and 0 <= s <= MAX_TOKEN_ID:
            ids.append(int(s))
        else:
            raise bad_request(f"'stop' must be a non-empty string or a list of non-empty strings (or token ids), "
                              f"got {v!r}", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}", "stop")
    t = body.get("stop_token_ids")
    if t is not None:
        if not isinstance(t, list) or not all(_is_int(x) and 0 <= x <= MAX_TOKEN_ID for x in t):
            raise bad_request(f"'stop_token_ids' must be a list of token ids (ints in 0..{MAX_TOKEN_ID})",
                              "stop_token_ids")
        ids.extend(int(x) for x in t)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}", "stop_token_ids")
    return strings, ids


def check_json(body: Any) -> None:
    """Refuses (400, naming the top-level field) a body nested deeper than
    ``MAX_JSON_DEPTH`` or holding a string that is not valid Unicode text (JSON allows a
    lone surrogate such as ``"\\ud800"``; no tokenizer can encode it). Iterative: a deep
    body must not exhaust the stack here either."""
    todo: list[tuple[Any, int, str | None]] = [(body, 0, None)]
    while todo:
        v, depth, top = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = f"'{top}'" if top else "the request body"
                raise bad_request(f"{where} holds a string that is not valid UTF-8 text ({e.reason} at index "
                                  f"{e.start}); send text without lone surrogates", top) from None
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                where = f"'{top}'" if top else "the request body"
                raise bad_request(f"{where} nests objects/arrays deeper than {MAX_JSON_DEPTH} levels", top)
            items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
            for k, x in items:
                field_name = top if top is not None or depth > 0 else k
                if k is not None:
                    todo.append((k, depth + 1, field_name))
                todo.append((x, depth + 1, field_name))


def _common(body: Any, kind: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_json(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the id GET /v1/models lists", "model")
    _unsupported(body)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object such as {\"include_usage\": true}", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed with \"stream\": true", "stream_options")
        include_usage = _bool(so, "include_usage")
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 1, MAX_TOKENS)
    top_k = _int(body, "top_k", -1, MAX_TOP_K)
    if top_k == 0:
        top_k = -1  # 0 means "off" in several clients
    stop, stop_ids = _stops(body)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0.0 < temperature < MIN_TEMPERATURE:  # logits / T would leave float32: greedy is what was meant
        temperature = 0.0
    return GenerateRequest(
        kind=kind, model=model, max_tokens=max_tokens,
        temperature=temperature,
        # top_p 0 asks for the single most likely token; the sampler keeps at least that one
        top_p=max(_number(body, "top_p", 1.0, 0.0, 1.0), 1e-9),
        top_k=-1 if top_k is None else top_k,
        seed=_int(body, "seed", 0, MAX_SEED),
        stop=stop, stop_token_ids=stop_ids, ignore_eos=_bool(body, "ignore_eos"),
        stream=stream, include_usage=include_usage)


def parse_completion(body: Any) -> GenerateRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a
    one-element list of either."""
    req = _common(body, "completion")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        req.prompt = p
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        req.prompt_ids = [int(t) for t in p]
    elif isinstance(p, list) and len(p) > 1:
        raise bad_request(f"send one prompt per request (got a list of {len(p)} prompts)", "prompt")
    else:
        raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")
    if req.prompt == "":
        raise bad_request("'prompt' is empty; send some text", "prompt")
    return req


def parse_chat(body: Any) -> GenerateRequest:
    """``POST /v1/chat/completions``: ``messages`` is checked by the chat template's
    normalizer when the front renders it."""
    req = _common(body, "chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                          "messages")
    req.messages = msgs
    req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    return req


