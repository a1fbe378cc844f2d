"""Mooncake-format traces: reading, writing and generating them.

One JSON object a line: ``timestamp`` (arrival, milliseconds from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token
block of the prompt, the last one possibly partial; equal ids are the same KV block, so
the first n equal ids of two requests are a shared prefix of n blocks).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["Request", "load_trace", "save_trace", "generate_trace", "BLOCK_TOKENS"]

#: Tokens per block of the published Mooncake traces.
BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def full_blocks(self, block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
        """The ids of the prompt's full blocks (only those are cached and reused)."""
        return self.hash_ids[: self.input_length // block_tokens]

    def to_json(self) -> str:
        ts: float | int = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() else self.timestamp_ms
        return json.dumps(
            {
                "timestamp": ts,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


def _int_field(obj: dict, name: str, lineno: int, minimum: int) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidArgument(f"line {lineno}: {name!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _parse_line(line: str, lineno: int) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise InvalidArgument(f"line {lineno}: 'timestamp' must be a finite number of milliseconds >= 0, got {ts!r}")
    inp = _int_field(obj, "input_length", lineno, 1)
    out = _int_field(obj, "output_length", lineno, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise InvalidArgument(f"line {lineno}: 'hash_ids' must be a list of integers, got {type(ids).__name__}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or h < 0 or h >= 1 << 128:
            raise InvalidArgument(f"line {lineno}: 'hash_ids' must hold integers in [0, 2**128), got {h!r}")
    if len(ids) > -(-inp // BLOCK_TOKENS):  # a Mooncake trace has ceil(input_length / 512) ids
        raise InvalidArgument(
            f"line {lineno}: {len(ids)} hash_ids are more blocks than input_length {inp} holds"
            f" ({BLOCK_TOKENS} tokens a block)"
        )
    return Request(float(ts), inp, out, tuple(ids))


def load_trace(path: str | os.PathLike[str]) -> list[Request]:
    """Reads a Mooncake JSONL trace; requests are returned sorted by arrival (stable).

    A malformed line raises :class:`InvalidArgument` naming its line number (1-based).
    Blank lines are skipped. Fewer ``hash_ids`` than blocks is allowed (a trace may list
    only the hashed prefix); more is an error.
    """
    reqs: list[Request] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InvalidArgument(f"cannot read trace {os.fspath(path)!r}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                reqs.append(_parse_line(line, lineno))
    reqs.sort(key=lambda r: r.timestamp_ms)
    return reqs


def save_trace(trace: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """Writes ``trace`` as Mooncake JSONL (one request a line)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(r.to_json())
            f.write("\n")


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks_for(prefix_full: list[int], total_tokens: int, ids: _Ids) -> tuple[list[int], list[int]]:
    """Ids of a prompt of ``total_tokens`` that starts with the full blocks
    ``prefix_full``: (its full-block ids, all its ids including a partial last block)."""
    n_full = total_tokens // BLOCK_TOKENS
    keep = min(len(prefix_full), n_full)
    full = prefix_full[:keep] + ids.take(n_full - keep)
    partial = ids.take(1) if total_tokens % BLOCK_TOKENS else []
    return full, full + partial


def _arrivals(rng: random.Random, n: int, rate: float, arrival: str, burst_factor: float, burst_period_s: float) -> list[float]:
    """``n`` session start times (seconds) at mean ``rate`` per second."""
    out: list[float] = []
    t = 0.0
    if arrival == "poisson":
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    # bursty: alternate on/off periods; during "on" the rate is burst_factor x, "off"
    # is set so that the long-run mean is `rate` (on and off last half a period each).
    hi = rate * burst_factor
    lo = max(rate * 2.0 - hi, rate * 0.05)
    half = burst_period_s / 2.0
    while len(out) < n:
        period_start = math.floor(t / burst_period_s) * burst_period_s
        on = (t - period_start) < half
        r = hi if on else lo
        dt = rng.expovariate(r)
        boundary = period_start + (half if on else burst_period_s)
        if t + dt >= boundary:
            t = boundary  # memoryless: restart the clock at the rate change
            continue
        t += dt
        out.append(t)
    return out


def generate_trace(
    num_requests: int = 1000,
    *,
    rate: float = 4.0,
    arrival: str = "poisson",
    burst_factor: float = 4.0,
    burst_period_s: float = 60.0,
    system_prompts: int = 8,
    system_prompt_tokens: tuple[int, int] = (1024, 4096),
    conversation_share: float = 0.6,
    turns: tuple[int, int] = (1, 8),
    user_tokens: tuple[int, int] = (64, 1024),
    think_time_s: float = 30.0,
    documents: int = 64,
    document_tokens: tuple[int, int] = (8192, 65536),
    document_zipf: float = 1.1,
    question_tokens: tuple[int, int] = (32, 512),
    output_tokens: tuple[int, int] = (16, 512),
    seed: int = 0,
    path: str | os.PathLike[str] | None = None,
    kind: str = "chat",
    agents: int = 4,
    agent_context_tokens: tuple[int, int] = (8192, 32768),
    task_tokens: tuple[int, int] = (256, 2048),
    tool_calls: tuple[int, int] = (5, 40),
    tool_result_tokens: tuple[int, int] = (64, 1024),
    agent_output_tokens: tuple[int, int] = (16, 256),
    tool_latency_s: float = 2.0,
    max_context_tokens: int = 131072,
) -> list[Request]:
    """A synthetic workload in the Mooncake format, deterministic for ``seed``.

    ``kind="agentic"``: sessions are agent tasks (``rate`` tasks per second, same
    ``arrival`` options). A task uses one of ``agents`` shared agent contexts (system
    prompt and tool definitions, ``agent_context_tokens``), adds its task
    (``task_tokens``), then loops over ``tool_calls`` steps: each step's prompt is the
    whole context so far; the model answers briefly (``agent_output_tokens``: a tool
    call), the tool runs (``tool_latency_s`` on average, exponential) and its result
    (``tool_result_tokens``) is appended for the next step. A task stops early at
    ``max_context_tokens``. Every step reuses the previous step's full blocks, so hit
    rates reach 90-99%. The chat-only parameters are ignored, and the other way round.

    Sessions start at ``rate`` per second (``arrival="poisson"``, or ``"bursty"``: on/off
    periods of ``burst_period_s`` with ``burst_factor`` times the rate while on). A
    session is, with probability ``conversation_share``, a multi-turn conversation (a
    shared system prompt picked uniformly from ``system_prompts``, then turns, each
    prompt being the whole conversation so far, ``think_time_s`` apart on average);
    otherwise a long-document query (a system prompt, one of ``documents`` long
    documents picked with Zipf popularity ``document_zipf``, then a question). Ids are
    chained (an id stands for its whole prefix): a document after another system prompt
    gets other ids. Token ranges are uniform (lo, hi). Requests past ``num_requests`` are dropped. With
    ``path`` the trace is also written there.
    """
    if num_requests < 0:
        raise InvalidArgument(f"num_requests must be >= 0, got {num_requests}")
    if kind not in ("chat", "agentic"):
        raise InvalidArgument(f"kind must be 'chat' or 'agentic', got {kind!r}")
    if not (math.isfinite(rate) and rate > 0):
        raise InvalidArgument(f"rate must be a positive number of sessions per second, got {rate}")
    if arrival not in ("poisson", "bursty"):
        raise InvalidArgument(f"arrival must be 'poisson' or 'bursty', got {arrival!r}")
    if not (burst_factor >= 1 and burst_period_s > 0):
        raise InvalidArgument("burst_factor must be >= 1 and burst_period_s > 0")
    if not 0.0 <= conversation_share <= 1.0:
        raise InvalidArgument(f"conversation_share must be in [0, 1], got {conversation_share}")
    if system_prompts < 1 or documents < 1:
        raise InvalidArgument("system_prompts and documents must be >= 1")
    if think_time_s < 0 or document_zipf < 0:
        raise InvalidArgument("think_time_s and document_zipf must be >= 0")
    for name, (lo, hi), low in (
        ("system_prompt_tokens", system_prompt_tokens, 0),
        ("turns", turns, 1),
        ("user_tokens", user_tokens, 1),
        ("document_tokens", document_tokens, 1),
        ("question_tokens", question_tokens, 1),
        ("output_tokens", output_tokens, 1),
    ):
        if not low <= lo <= hi:
            raise InvalidArgument(f"{name} must be (lo, hi) with {low} <= lo <= hi, got {(lo, hi)}")

    if kind == "agentic":
        trace = _agentic(
            num_requests,
            rate=rate,
            arrival=arrival,
            burst_factor=burst_factor,
            burst_period_s=burst_period_s,
            agents=agents,
            agent_context_tokens=agent_context_tokens,
            task_tokens=task_tokens,
            tool_calls=tool_calls,
            tool_result_tokens=tool_result_tokens,
            agent_output_tokens=agent_output_tokens,
            tool_latency_s=tool_latency_s,
            max_context_tokens=max_context_tokens,
            seed=seed,
        )
        if path is not None:
            save_trace(trace, path)
        return trace
    rng = random.Random(seed)
    ids = _Ids()
    # Shared system prompts and documents: token lengths rounded to whole blocks so
    # the shared part is exactly reusable.
    def blocks(lo: int, hi: int) -> list[int]:
        return ids.take(rng.randint(lo, hi) // BLOCK_TOKENS)

    sys_prompts = [blocks(*system_prompt_tokens) for _ in range(system_prompts)]
    docs = [blocks(*document_tokens) for _ in range(documents)]
    # Ids are chained (an id stands for its whole prefix, as the product's hashes and
    # Mooncake's remapped ids do): a document after another system prompt is other KV,
    # so it gets its own ids per (system prompt, document) pair, the first pair keeping
    # `docs`' ids. Shared ids there let a cache serve one prompt's KV to another.
    doc_ids: dict[tuple[int, int], list[int]] = {}
    doc_owner: dict[int, int] = {}
    doc_weights = [1.0 / (i + 1) ** document_zipf for i in range(documents)]

    events: list[tuple[float, int, Request]] = []
    seq = 0
    starts = _arrivals(rng, num_requests, rate, arrival, burst_factor, burst_period_s)
    for start in starts:
        sp_idx = rng.randrange(system_prompts)
        sp = sys_prompts[sp_idx]
        if rng.random() < conversation_share:
            n_turns = rng.randint(*turns)
            full = list(sp)
            tokens = len(sp) * BLOCK_TOKENS
            t = start
            for _ in range(n_turns):
                total = tokens + rng.randint(*user_tokens)
                full, all_ids = _blocks_for(full, total, ids)
                out = rng.randint(*output_tokens)
                events.append((t, seq, Request(round(t * 1000.0, 3), total, out, tuple(all_ids))))
                seq += 1
                # the next turn's prompt is this prompt, its answer and a new message:
                # this prompt's full blocks stay a reusable prefix
                tokens = total + out
                t += rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
        else:
            d = rng.choices(range(documents), weights=doc_weights)[0]
            doc = doc_ids.get((sp_idx, d))
            if doc is None:
                doc = docs[d] if doc_owner.setdefault(d, sp_idx) == sp_idx else ids.take(len(docs[d]))
                doc_ids[(sp_idx, d)] = doc
            prefix = list(sp) + list(doc)
            total = len(prefix) * BLOCK_TOKENS + rng.randint(*question_tokens)
            _, all_ids = _blocks_for(prefix, total, ids)
            out = rng.randint(*output_tokens)
            events.append((start, seq, Request(round(start * 1000.0, 3), total, out, tuple(all_ids))))
            seq += 1
    events.sort(key=lambda e: (e[0], e[1]))
    trace = [r for _, _, r in events[:num_requests]]
    if path is not None:
        save_trace(trace, path)
    return trace


def _agentic(
    num_requests: int,
    *,
    rate: float,
    arrival: str,
    burst_factor: float,
    burst_period_s: float,
    agents: int,
    agent_context_tokens: tuple[int, int],
    task_tokens: tuple[int, int],
    tool_calls: tuple[int, int],
    tool_result_tokens: tuple[int, int],
    agent_output_tokens: tuple[int, int],
    tool_latency_s: float,
    max_context_tokens: int,
    seed: int,
) -> list[Request]:
    """Agent tasks as tool loops (see :func:`generate_trace`, ``kind="agentic"``)."""
    if agents < 1:
        raise InvalidArgument(f"agents must be >= 1, got {agents}")
    if not (math.isfinite(tool_latency_s) and tool_latency_s >= 0):
        raise InvalidArgument(f"tool_latency_s must be a finite number >= 0, got {tool_latency_s}")
    for name, (lo, hi), low in (
        ("agent_context_tokens", agent_context_tokens, 0),
        ("task_tokens", task_tokens, 1),
        ("tool_calls", tool_calls, 1),
        ("tool_result_tokens", tool_result_tokens, 1),
        ("agent_output_tokens", agent_output_tokens, 1),
    ):
        if not low <= lo <= hi:
            raise InvalidArgument(f"{name} must be (lo, hi) with {low} <= lo <= hi, got {(lo, hi)}")
    if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int) or max_context_tokens < 1:
        raise InvalidArgument(f"max_context_tokens must be an integer >= 1, got {max_context_tokens!r}")
    rng = random.Random(seed)
    ids = _Ids()
    contexts = [ids.take(rng.randint(*agent_context_tokens) // BLOCK_TOKENS) for _ in range(agents)]
    events: list[tuple[float, int, Request]] = []
    seq = 0
    for start in _arrivals(rng, num_requests, rate, arrival, burst_factor, burst_period_s):
        ctx = contexts[rng.randrange(agents)]
        full = list(ctx)
        total = len(ctx) * BLOCK_TOKENS + rng.randint(*task_tokens)
        t = start
        for _ in range(rng.randint(*tool_calls)):
            if total > max_context_tokens:
                break
            full, all_ids = _blocks_for(full, total, ids)
            out = rng.randint(*agent_output_tokens)
            events.append((t, seq, Request(round(t * 1000.0, 3), total, out, tuple(all_ids))))
            seq += 1
            # the next step's prompt: this one, the model's tool call, the tool's result
            total += out + rng.randint(*tool_result_tokens)
            t += rng.expovariate(1.0 / tool_latency_s) if tool_latency_s > 0 else 0.0
    events.sort(key=lambda e: (e[0], e[1]))
    return [r for _, _, r in events[:num_requests]]


def trace_stats(trace: Sequence[Request]) -> dict[str, float]:
    """Request count, duration, mean input/output lengths and distinct full blocks."""
    n = len(trace)
    if n == 0:
        return {"requests": 0, "duration_s": 0.0, "mean_input": 0.0, "mean_output": 0.0, "distinct_blocks": 0}
    distinct: set[int] = set()
    for r in trace:
        distinct.update(r.full_blocks())
    return {
        "requests": n,
        "duration_s": (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0,
        "mean_input": sum(r.input_length for r in trace) / n,
        "mean_output": sum(r.output_length for r in trace) / n,
        "distinct_blocks": len(distinct),
    }
