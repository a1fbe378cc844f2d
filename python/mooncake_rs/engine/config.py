"""Model configuration of the Llama family, and presets.

A :class:`ModelConfig` holds the dimensions and the numerics switches (RoPE theta and
scaling, RMSNorm epsilon, tied embeddings) that the engine needs. It is built directly,
from a preset (:meth:`ModelConfig.preset`), or from a Hugging Face ``config.json``
(:meth:`ModelConfig.from_hf_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument

__all__ = ["ModelConfig", "PRESETS", "DTYPES"]

#: dtype names accepted by the engine.
DTYPES = ("float32", "bfloat16", "float16")

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU).

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` (``"linear"`` with
    ``factor``, or ``"llama3"`` with ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    name: str = "custom"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "intermediate_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise InvalidArgument(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise InvalidArgument(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be a positive even int, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise InvalidArgument("rms_norm_eps and rope_theta must be positive")
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise InvalidArgument(f"rope_scaling type {kind!r} is not supported (one of {_ROPE_TYPES})")
            rs["rope_type"] = kind
            if kind != "default" and float(rs.get("factor", 0)) <= 0:
                raise InvalidArgument("rope_scaling.factor must be positive")
            if kind == "llama3":
                for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    if k not in rs:
                        raise InvalidArgument(f"llama3 rope_scaling needs {k}")
                if float(rs["high_freq_factor"]) <= float(rs["low_freq_factor"]):
                    raise InvalidArgument("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
            object.__setattr__(self, "rope_scaling", None if kind == "default" else rs)

    # ---- derived sizes
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Number of weights (embeddings counted once when tied)."""
        h, i, l = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """KV bytes of one token over all layers."""
        return self.num_layers * 2 * self.kv_size * dtype_size

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- constructors
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A preset by name: ``tiny``, ``llama-3-8b``, ``llama-3-70b`` (case-insensitive)."""
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise InvalidArgument(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[key]

    @classmethod
    def tiny(cls) -> "ModelConfig":
        return PRESETS["tiny"]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face Llama ``config.json`` (transformers 4.x or 5.x keys)."""
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        mtype = cfg.get("model_type", "llama")
        if mtype not in ("llama", "mistral") or not any("CausalLM" in a for a in arch):
            raise InvalidArgument(f"only Llama-family causal LMs are supported, got model_type={mtype!r} {arch}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise InvalidArgument("attention_bias / mlp_bias are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if cfg.get("sliding_window"):
            raise InvalidArgument("sliding-window attention is not supported")
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        heads = int(cfg["num_attention_heads"])
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            dtype=dtype if dtype in DTYPES else "float32",
            name=str(cfg.get("_name_or_path") or "hf"),
        )


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    # A few hundred thousand weights: for tests and the CPU demo.
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=4096, rope_theta=10000.0,
                        eos_token_ids=(), name="tiny"),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, intermediate_size=14336, max_position_embeddings=131072,
                              rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5,
                              eos_token_ids=(128001, 128009), dtype="bfloat16", name="llama-3-8b"),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                               num_kv_heads=8, intermediate_size=28672, max_position_embeddings=131072,
                               rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5,
                               eos_token_ids=(128001, 128009), dtype="bfloat16", name="llama-3-70b"),
}
