"""Model configuration of the supported decoder families, and presets.

A :class:`ModelConfig` holds the dimensions and the numerics switches (RoPE theta and
scaling, RMSNorm epsilon, tied embeddings, projection biases, q/k norm) that the engine
needs. It is built directly, from a preset (:meth:`ModelConfig.preset`), or from a Hugging
Face ``config.json`` (:meth:`ModelConfig.from_hf_config`; the families it reads are in
:data:`SUPPORTED_ARCHITECTURES`). Every family shares one decoder (RMSNorm, RoPE, GQA,
SwiGLU); they differ only in the switches, so there is one model and one weight layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument

__all__ = ["ModelConfig", "PRESETS", "DTYPES", "SUPPORTED_ARCHITECTURES", "model_dir_config"]

#: dtype names accepted by the engine.
DTYPES = ("float32", "bfloat16", "float16")

_ROPE_TYPES = ("default", "linear", "llama3")

#: Hugging Face ``architectures`` names that :meth:`ModelConfig.from_hf_config` reads.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# config.json files without an ``architectures`` list name their family by model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder (RMSNorm, RoPE, GQA, SwiGLU) and its family switches.

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` (``"linear"`` with
    ``factor``, or ``"llama3"`` with ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    ``qkv_bias``: the q, k and v projections add a bias (Qwen2, Llama/Qwen3 with
    ``attention_bias``); ``o_bias``: the output projection does (Llama/Qwen3 with
    ``attention_bias``); ``qk_norm``: q and k get a per-head RMSNorm over ``head_dim``
    before RoPE (Qwen3); ``mlp_bias``: the gate, up and down projections add a bias
    (Llama with ``mlp_bias``). ``sliding_window``: every layer attends to its last
    ``sliding_window`` positions only (Mistral); ``None`` (or a window no shorter than
    ``max_position_embeddings``, which never masks) is full causal attention.
    ``architecture`` is informational (the Hugging Face class name).
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
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    architecture: str = "LlamaForCausalLM"
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
        for f in ("qkv_bias", "o_bias", "qk_norm", "mlp_bias", "tie_word_embeddings"):
            object.__setattr__(self, f, bool(getattr(self, f)))
        w = self.sliding_window
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
                raise InvalidArgument(f"sliding_window must be None or a positive int, got {w!r}")
            if w >= self.max_position_embeddings:  # never masks anything: full attention
                object.__setattr__(self, "sliding_window", None)
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
        per_layer += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        per_layer += 2 * self.head_dim * self.qk_norm + (2 * i + h) * self.mlp_bias
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
        """A preset by name: ``tiny``, ``tiny-gpu`` (head_dim 64, which FlashInfer has
        kernels for), ``llama-3-8b``, ``llama-3-70b`` (case-insensitive)."""
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise InvalidArgument(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[key]

    @classmethod
    def tiny(cls) -> "ModelConfig":
        return PRESETS["tiny"]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face ``config.json`` (transformers 4.x or 5.x keys) of one of
        :data:`SUPPORTED_ARCHITECTURES`; anything else, a missing key or a value of the
        wrong kind raises :class:`InvalidArgument`."""
        if not isinstance(cfg, dict):
            raise InvalidArgument(f"a config.json must hold a JSON object, got {type(cfg).__name__}")
        try:
            return cls._from_hf(cfg)
        except InvalidArgument:  # already says what to fix (it is a ValueError too)
            raise
        except KeyError as e:
            raise InvalidArgument(f"config.json lacks the key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:  # int("x"), float(None), ...
            raise InvalidArgument(f"config.json has a value of the wrong kind: {e}") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        mlp_bias = bool(cfg.get("mlp_bias", False))
        if mlp_bias and arch != "LlamaForCausalLM":
            raise InvalidArgument(f"{arch} with mlp_bias is not supported (LlamaForCausalLM only)")
        heads = int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = _sliding_window(arch, cfg, max_pos)
        attention_bias = bool(cfg.get("attention_bias", False))
        if arch == "Qwen2ForCausalLM":  # q/k/v always carry a bias, o never (attention_bias is not read)
            qkv_bias, o_bias = True, False
        elif arch == "MistralForCausalLM":
            if attention_bias:
                raise InvalidArgument("MistralForCausalLM with attention_bias is not supported")
            qkv_bias = o_bias = False
        else:  # Llama and Qwen3: attention_bias puts a bias on q, k, v and o
            qkv_bias = o_bias = attention_bias
        head_dim = cfg.get("head_dim")
        if head_dim is None and arch == "Qwen3ForCausalLM":
            head_dim = 128  # Qwen3's own default, not hidden_size // heads
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            head_dim=int(head_dim or 0),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if arch == "LlamaForCausalLM" else 1e-6)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            dtype=dtype if dtype in DTYPES else "float32",
            name=str(cfg.get("_name_or_path") or "hf"),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=mlp_bias,
            sliding_window=window,
            architecture=arch,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    """The supported architecture a config.json names (``architectures``, else
    ``model_type``; neither: Llama, as older hand-written configs assume)."""
    archs = cfg.get("architectures")
    mtype = cfg.get("model_type")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                return str(a)
        named = f"architectures {list(archs)}"
    elif mtype is None:
        return "LlamaForCausalLM"
    elif mtype in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mtype]
    else:
        named = f"model_type {mtype!r}"
    raise InvalidArgument(f"unsupported model: config.json names {named}; supported architectures are "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _sliding_window(arch: str, cfg: dict[str, Any], max_pos: int) -> int | None:
    """The window every layer attends within, or ``None`` for full attention.

    A window at least ``max_position_embeddings`` long never masks anything, so it is full
    attention. Windows on some layers only (Qwen's ``max_window_layers`` / ``layer_types``
    mixes) are refused: the engine plans one attention pattern for all layers."""
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise InvalidArgument(f"{arch}: sliding_window must be null or a positive int, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        kinds = {str(t) for t in types}
        if kinds - {"full_attention", "sliding_attention"}:
            raise InvalidArgument(f"{arch}: layer_types {sorted(kinds)} are not supported "
                                  "(full_attention and sliding_attention only)")
    if window is None or window >= max_pos:
        return None
    if arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return int(window)
    # Qwen configs carry a sliding_window even when it is off: use_sliding_window and the
    # per-layer layer_types decide (transformers windows the layers from max_window_layers on)
    n = int(cfg["num_hidden_layers"])
    if types is None:
        if not cfg.get("use_sliding_window"):
            return None
        first = int(cfg.get("max_window_layers", n))
        types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    kinds = {str(t) for t in types}
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return int(window)
    raise InvalidArgument(
        f"{arch}: sliding-window attention on some layers only (layer_types {list(types)}, window {window}) "
        "is not supported; the engine supports full attention or one window on every layer")


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    # A few hundred thousand weights: for tests and the CPU demo.
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=4096, rope_theta=10000.0,
                        eos_token_ids=(), name="tiny"),
    # The smallest shape FlashInfer has kernels for (head_dim 64): for the GPU tests.
    "tiny-gpu": ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=512, max_position_embeddings=4096, rope_theta=10000.0,
                            eos_token_ids=(), dtype="bfloat16", name="tiny-gpu"),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, intermediate_size=14336, max_position_embeddings=131072,
                              rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5,
                              eos_token_ids=(128001, 128009), dtype="bfloat16", name="llama-3-8b"),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                               num_kv_heads=8, intermediate_size=28672, max_position_embeddings=131072,
                               rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE), rms_norm_eps=1e-5,
                               eos_token_ids=(128001, 128009), dtype="bfloat16", name="llama-3-70b"),
}


def model_dir_config(path: str | Path, *, weights: bool = True) -> ModelConfig:
    """The ModelConfig of a local Hugging Face model directory, checked before anything
    starts on it: a readable config.json of a supported family and (``weights``) its
    ``*.safetensors`` files. Raises :class:`InvalidArgument` with a one-line reason."""
    import json

    d = Path(path)
    if not d.is_dir():
        raise InvalidArgument(f"{str(path)!r} is not a directory: pass a Hugging Face model directory, a preset "
                              f"name ({', '.join(sorted(PRESETS))}), or make one with `mooncake-rs make-model DIR`")
    try:
        raw = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"{d} has no config.json: a model directory holds the Hugging Face config.json, "
                              "*.safetensors weights and the tokenizer files") from None
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{d / 'config.json'} is not readable JSON: {e}") from None
    cfg = ModelConfig.from_hf_config(raw)
    if weights and not (d / "model.safetensors.index.json").is_file() and not any(d.glob("*.safetensors")):
        raise InvalidArgument(f"{d} holds no *.safetensors weights (only safetensors are read; convert a "
                              "pytorch_model.bin with safetensors' convert script)")
    return cfg
