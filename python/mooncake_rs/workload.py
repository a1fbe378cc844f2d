"""Generated multi-turn chat workloads (token ids only; no tokenizer, no downloads).

A conversation starts with one of a few shared system prompts, then alternates user
turns and model replies; every turn's prompt is the whole conversation so far, so each
turn shares its prefix with the previous one, and conversations that use the same
system prompt share that prefix with each other — the reuse Mooncake is built on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .errors import InvalidArgument


@dataclass(frozen=True)
class ChatRequest:
    """One turn of one conversation."""

    conversation: int
    turn: int
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0


@dataclass
class ChatWorkload:
    """Knobs of :func:`generate_chat_workload`; validated on construction."""

    conversations: int = 64
    turns: int = 4
    system_prompts: int = 4
    system_prompt_len: int = 512
    user_len: tuple[int, int] = (32, 160)
    output_len: tuple[int, int] = (16, 96)
    vocab: int = 32_000
    mean_interarrival_s: float = 0.05
    seed: int = 0
    _checked: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "vocab"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 0:
            raise InvalidArgument(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")
        for name in ("user_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InvalidArgument(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.mean_interarrival_s < 0:
            raise InvalidArgument("mean_interarrival_s must be >= 0")


def generate_chat_workload(cfg: ChatWorkload | None = None) -> list[ChatRequest]:
    """Requests of ``cfg`` in arrival order (turns of different conversations interleave).

    Deterministic for a seed.
    """
    cfg = cfg or ChatWorkload()
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(cfg.vocab) for _ in range(n)]

    systems = [tokens(cfg.system_prompt_len) for _ in range(cfg.system_prompts)]
    histories = [list(systems[rng.randrange(cfg.system_prompts)]) for _ in range(cfg.conversations)]
    next_turn = [0] * cfg.conversations
    # Interleave: each step picks a random conversation that still has turns left.
    open_convs = list(range(cfg.conversations))
    out: list[ChatRequest] = []
    now = 0.0
    while open_convs:
        c = open_convs[rng.randrange(len(open_convs))]
        histories[c].extend(tokens(rng.randint(*cfg.user_len)))
        output_len = rng.randint(*cfg.output_len)
        if cfg.mean_interarrival_s > 0:
            now += rng.expovariate(1.0 / cfg.mean_interarrival_s)
        out.append(ChatRequest(c, next_turn[c], list(histories[c]), output_len, now))
        histories[c].extend(tokens(output_len))  # the model's reply joins the history
        next_turn[c] += 1
        if next_turn[c] == cfg.turns:
            open_convs.remove(c)
    return out
