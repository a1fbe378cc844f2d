"""``Frontend``: the transport-free core of the HTTP front door.

It owns what sits between an OpenAI request and ``Cluster.submit``: the model's name and
context length, the tokenizer and chat template, the defaults and checks of the sampling
parameters, and the front's counters. The ASGI app (app.py) only moves bytes.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, MooncakeError, ServiceUnavailable
from .errors import ApiError, bad_request, from_exception, unavailable
from .generation import Generation
from .limits import FrontLimits
from .metrics import FrontMetrics
from .protocol import GenerateRequest

__all__ = ["Frontend"]


def _roles(cluster: Any) -> tuple[int, int]:
    """Live prefill and decode instances."""
    roles = list(cluster.instance_roles().values())
    return roles.count("prefill"), roles.count("decode")


class Frontend:
    """Serves one model of a cluster over the OpenAI API.

    ``cluster``: anything with ``Cluster``'s public API (``submit``, ``instance_roles``,
    ``metrics_text``). ``tokenizer``: a :class:`mooncake_rs.text.Tokenizer`.
    ``model_name``: the id clients send as ``model``. ``max_model_len``: the context
    (prompt + output tokens). ``eos_token_ids``: ids that end generation (the model's
    config; the tokenizer's EOS is added). ``api_key``: when set, ``/v1/*`` needs
    ``Authorization: Bearer <key>``. ``request_timeout_s``: a deadline per request.
    """

    def __init__(self, cluster: Any, tokenizer: Any, model_name: str, *, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), api_key: str | None = None,
                 request_timeout_s: float | None = None, default_max_tokens: int = 16,
                 limits: FrontLimits | None = None) -> None:
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        eos = set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.api_key = api_key or None
        self.request_timeout_s = request_timeout_s
        self.default_max_tokens = int(default_max_tokens)
        self.created = int(time.time())
        self.metrics = FrontMetrics()
        self.limits = limits or FrontLimits()
        # requests running now (a shutdown ends them: drain); touched from the event loop
        # and, when a request ends, from the thread that ended it
        self._running: set[Generation] = set()
        self._running_lock = threading.Lock()
        self.draining = False

    @property
    def active_requests(self) -> int:
        return len(self._running)

    def drain(self, reason: str) -> int:
        """Refuses new requests (503) and ends every running one with ``ServiceUnavailable``
        (a stream gets an error event and ``[DONE]``). Returns how many were ended."""
        self.draining = True
        with self._running_lock:
            running = list(self._running)
        for gen in running:
            gen.close(reason, ServiceUnavailable(reason))
        return len(running)

    def _forget(self, gen: Generation) -> None:
        with self._running_lock:
            self._running.discard(gen)

    @classmethod
    def from_model_dir(cls, cluster: Any, model_dir: str | Path, *, tokenizer_dir: str | Path | None = None,
                       model_name: str | None = None, **kw: Any) -> "Frontend":
        """The tokenizer from ``tokenizer_dir`` (default: the model directory), the context
        length and EOS ids from its ``config.json``."""
        from ..text import Tokenizer

        d = Path(model_dir)
        try:
            cfg = json.loads((d / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"{d} has no readable config.json ({e}); --model takes a Hugging Face model "
                                  "directory") from None
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(t) for t in eos)
        tok = Tokenizer.from_dir(tokenizer_dir or d)
        return cls(cluster, tok, model_name or d.resolve().name,
                   max_model_len=int(cfg.get("max_position_embeddings", 2048)), eos_token_ids=eos_ids, **kw)

    # ---- health
    def serving_state(self) -> tuple[bool, str]:
        """(ready, why): ready when at least one prefill and one decode instance are alive."""
        p, d = _roles(self.cluster)
        if p and d:
            return True, f"{p} prefill and {d} decode instances up"
        return False, f"no instance can serve: {p} prefill and {d} decode instances up"

    def check_auth(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        expected = f"Bearer {self.api_key}"
        if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>' (the key the "
                                "server was started with, --api-key)", code="invalid_api_key")

    # ---- requests
    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        tok = self.tokenizer
        if req.kind == "chat":
            return tok.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt)
        if req.prompt_ids is not None:
            bad = next((t for t in req.prompt_ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary 0..{tok.vocab_size - 1}",
                                  "prompt")
            return list(req.prompt_ids)
        assert req.prompt is not None
        return tok.encode(req.prompt)

    def start(self, req: GenerateRequest) -> Generation:
        """Tokenizes, checks and submits ``req``; returns its running :class:`Generation`.
        Raises ``ApiError`` (400 bad input or unknown model, 429 overloaded, 503 no
        instance)."""
        if req.model != self.model_name:
            raise ApiError(400, f"model {req.model!r} is not served here; use {self.model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica or after it restarts",
                           type="service_unavailable", code="shutting_down", headers={"Retry-After": "1"})
        ready, why = self.serving_state()
        if not ready:
            raise unavailable(why)
        from ..engine import SamplingParams

        try:
            prompt = self._prompt_ids(req)
        except InvalidArgument as e:
            raise bad_request(str(e), "messages" if req.kind == "chat" else "prompt") from None
        if not prompt:
            raise bad_request("the prompt encodes to no tokens; send some text", "prompt")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise bad_request(f"the prompt has {len(prompt)} tokens, the model's context is {self.max_model_len}: "
                              "shorten the prompt", "messages" if req.kind == "chat" else "prompt",
                              code="context_length_exceeded")
        if req.max_tokens is None:
            max_tokens = room if req.kind == "chat" else min(self.default_max_tokens, room)
        else:
            max_tokens = req.max_tokens
            if max_tokens > room:
                raise bad_request(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                  f"model's context of {self.max_model_len} tokens: lower max_tokens to at most "
                                  f"{room} or shorten the prompt", "max_tokens", code="context_length_exceeded")
        stop_ids = set(req.stop_token_ids)
        hidden = frozenset(stop_ids | (set() if req.ignore_eos else set(self.eos_token_ids)))
        # The engine stops on the model's EOS itself; the tokenizer's EOS (a chat model's
        # end-of-turn) and explicit stop ids go in as stop tokens.
        engine_stops = stop_ids | (set() if req.ignore_eos or self.tokenizer.eos_token_id is None
                                   else {int(self.tokenizer.eos_token_id)})
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                                    top_p=req.top_p, seed=req.seed, stop_token_ids=tuple(sorted(engine_stops)),
                                    ignore_eos=req.ignore_eos)
            handle = self.cluster.submit(prompt, params, timeout_s=self.request_timeout_s)
        except MooncakeError as e:
            err = from_exception(e)
            if err.status == 429:
                self.metrics.count("rejected")
            raise err from None
        t0 = time.monotonic()
        gen = Generation(handle, self.tokenizer, prompt_tokens=len(prompt), stop=req.stop, hidden_ids=hidden,
                         on_first_token=lambda: self.metrics.observe_ttft(time.monotonic() - t0),
                         on_close=self._forget)
        with self._running_lock:
            self._running.add(gen)
        return gen

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "mooncake-rs", "max_model_len": self.max_model_len}]}

    def metrics_text(self) -> str:
        return self.cluster.metrics_text() + self.metrics.prometheus()
