"""Model weights: seeded random init, or a local Hugging Face directory.

Weights are kept in the engine's own fused layout (:class:`LlamaWeights`): per layer one
``qkv`` matrix (q, k and v projections stacked, with their stacked bias when the family has
one) and one ``gate_up`` matrix, so a layer is two matmuls for attention projections and two
for the MLP; Qwen3's per-head q/k norms ride along. Nothing is ever downloaded:
:func:`load_hf_dir` reads ``config.json`` and ``*.safetensors`` (one file or shards with
``model.safetensors.index.json``) from a local directory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidArgument
from ..base.model_config import ModelConfig

__all__ = ["LayerWeights", "LlamaWeights", "random_weights", "load_hf_dir", "load_model", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise InvalidArgument(f"dtype must be float32, bfloat16 or float16, got {name!r}") from None


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    o: torch.Tensor  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    qkv_bias: torch.Tensor | None = None  # [q_size + 2 * kv_size] when cfg.qkv_bias
    o_bias: torch.Tensor | None = None  # [hidden] when cfg.o_bias
    q_norm: torch.Tensor | None = None  # [head_dim] when cfg.qk_norm
    k_norm: torch.Tensor | None = None  # [head_dim] when cfg.qk_norm
    gate_up_bias: torch.Tensor | None = None  # [2 * intermediate] when cfg.mlp_bias
    down_bias: torch.Tensor | None = None  # [hidden] when cfg.mlp_bias

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds (the optional ones only when present)."""
        ts = [self.attn_norm, self.qkv, self.o, self.mlp_norm, self.gate_up, self.down]
        extra = (self.qkv_bias, self.o_bias, self.q_norm, self.k_norm, self.gate_up_bias, self.down_bias)
        return ts + [t for t in extra if t is not None]

    def to(self, device: str | torch.device) -> "LayerWeights":
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LayerWeights(attn_norm=self.attn_norm.to(device), qkv=self.qkv.to(device), o=self.o.to(device),
                            mlp_norm=self.mlp_norm.to(device), gate_up=self.gate_up.to(device),
                            down=self.down.to(device), qkv_bias=mv(self.qkv_bias), o_bias=mv(self.o_bias),
                            q_norm=mv(self.q_norm), k_norm=mv(self.k_norm),
                            gate_up_bias=mv(self.gate_up_bias), down_bias=mv(self.down_bias))


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

    def nbytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            ts += lw.tensors()
        return sum(t.numel() * t.element_size() for t in ts)

    def to(self, device: str | torch.device) -> "LlamaWeights":
        """A copy on ``device`` (tied embeddings stay one tensor)."""
        embed = self.embed.to(device)
        lm_head = embed if self.lm_head is self.embed else self.lm_head.to(device)
        return LlamaWeights(embed=embed, layers=[lw.to(device) for lw in self.layers], norm=self.norm.to(device),
                            lm_head=lm_head)


def random_weights(cfg: ModelConfig, *, seed: int = 0, dtype: str = "float32",
                   device: str | torch.device = "cpu") -> LlamaWeights:
    """Seeded random weights (the same seed, config, dtype and device give the same weights).

    Matrices are drawn N(0, 1/fan_in) so activations stay of order one at any depth and
    greedy decoding has clear margins; norms are drawn around one.
    """
    dt = torch_dtype(dtype)
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))

    def mat(rows: int, cols: int) -> torch.Tensor:
        t = torch.empty(rows, cols, dtype=torch.float32 if dev.type == "cpu" else dt, device=dev)
        t.normal_(0.0, 1.0 / math.sqrt(cols), generator=gen)
        return t.to(dt)

    def norm(n: int = cfg.hidden_size) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.float32, device=dev)
        t.uniform_(0.8, 1.2, generator=gen)
        return t.to(dt)

    def bias(n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.float32, device=dev)
        t.normal_(0.0, 0.1, generator=gen)
        return t.to(dt)

    def layer() -> LayerWeights:
        lw = LayerWeights(attn_norm=norm(), qkv=mat(cfg.q_size + 2 * cfg.kv_size, h), o=mat(h, cfg.q_size),
                          mlp_norm=norm(), gate_up=mat(2 * cfg.intermediate_size, h),
                          down=mat(h, cfg.intermediate_size))
        # drawn after the Llama tensors, so a config without these switches keeps its old weights
        if cfg.qkv_bias:
            lw.qkv_bias = bias(cfg.q_size + 2 * cfg.kv_size)
        if cfg.o_bias:
            lw.o_bias = bias(h)
        if cfg.qk_norm:
            lw.q_norm, lw.k_norm = norm(cfg.head_dim), norm(cfg.head_dim)
        if cfg.mlp_bias:
            lw.gate_up_bias, lw.down_bias = bias(2 * cfg.intermediate_size), bias(h)
        return lw

    h = cfg.hidden_size
    embed = torch.empty(cfg.vocab_size, h, dtype=torch.float32 if dev.type == "cpu" else dt, device=dev)
    embed.normal_(0.0, 1.0, generator=gen)
    embed = embed.to(dt)
    layers = [layer() for _ in range(cfg.num_layers)]
    final = norm()
    lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, h)
    return LlamaWeights(embed=embed, layers=layers, norm=final, lm_head=lm_head)


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        wmap = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(wmap.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"{path} holds no *.safetensors file")
    return files


def load_hf_dir(path: str | Path, *, dtype: str | None = None,
                device: str | torch.device = "cpu") -> tuple[ModelConfig, LlamaWeights]:
    """Reads a local Hugging Face directory (config.json + safetensors) of a supported family.

    Tensor names are those of transformers' ``*ForCausalLM`` classes: per layer
    ``self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` when the family has one),
    ``self_attn.{q,k}_norm.weight`` (Qwen3), ``mlp.{gate,up,down}_proj.weight`` (and
    ``.bias`` with Llama's ``mlp_bias``) and the two layer norms. A tensor the config does
    not account for is an error (a config/checkpoint mismatch would otherwise load silently
    and compute garbage)."""
    from safetensors import safe_open

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidArgument(f"{p} is not a model directory (no config.json); nothing is downloaded")
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"{p / 'config.json'} is not readable JSON: {e}") from None
    cfg = ModelConfig.from_hf_config(raw)
    dt = torch_dtype(dtype or cfg.dtype)
    cfg = cfg.replace(dtype=dtype or cfg.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(p):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InvalidArgument(f"checkpoint {p} lacks tensor {name}")
        return tensors.pop(name)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dt).contiguous()

    def shaped(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = take(name)
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"checkpoint {p}: {name} has shape {tuple(t.shape)}, config.json implies {shape}")
        return t

    h, qs, kvs, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        att = pre + "self_attn."
        q, k, v = (shaped(att + f"{n}_proj.weight", (s, h)) for n, s in (("q", qs), ("k", kvs), ("v", kvs)))
        lw = LayerWeights(
            attn_norm=put(shaped(pre + "input_layernorm.weight", (h,))),
            qkv=put(torch.cat([q, k, v], 0)),
            o=put(shaped(att + "o_proj.weight", (h, qs))),
            mlp_norm=put(shaped(pre + "post_attention_layernorm.weight", (h,))),
            gate_up=put(torch.cat([shaped(pre + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                                   shaped(pre + "mlp.up_proj.weight", (cfg.intermediate_size, h))], 0)),
            down=put(shaped(pre + "mlp.down_proj.weight", (h, cfg.intermediate_size))),
        )
        if cfg.qkv_bias:
            lw.qkv_bias = put(torch.cat([shaped(att + f"{n}_proj.bias", (s,))
                                         for n, s in (("q", qs), ("k", kvs), ("v", kvs))]))
        if cfg.o_bias:
            lw.o_bias = put(shaped(att + "o_proj.bias", (h,)))
        if cfg.qk_norm:
            lw.q_norm = put(shaped(att + "q_norm.weight", (hd,)))
            lw.k_norm = put(shaped(att + "k_norm.weight", (hd,)))
        if cfg.mlp_bias:
            mi = cfg.intermediate_size
            lw.gate_up_bias = put(torch.cat([shaped(pre + "mlp.gate_proj.bias", (mi,)),
                                             shaped(pre + "mlp.up_proj.bias", (mi,))]))
            lw.down_bias = put(shaped(pre + "mlp.down_proj.bias", (h,)))
        layers.append(lw)
    embed = put(shaped("model.embed_tokens.weight", (cfg.vocab_size, h)))
    final = put(shaped("model.norm.weight", (h,)))
    if "lm_head.weight" in tensors and not cfg.tie_word_embeddings:
        lm_head = put(shaped("lm_head.weight", (cfg.vocab_size, h)))
    else:
        lm_head = embed
        cfg = cfg.replace(tie_word_embeddings=True)
        tensors.pop("lm_head.weight", None)  # a tied checkpoint may store the copy anyway
    # old checkpoints store RoPE's inverse frequencies; they are recomputed from the config
    left = sorted(n for n in tensors if not n.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise InvalidArgument(f"checkpoint {p} has tensors that config.json ({cfg.architecture}) does not use: "
                              f"{left[:5]}{more}; is the config of another model?")
    return cfg, LlamaWeights(embed=embed, layers=layers, norm=final, lm_head=lm_head)


def load_model(model: str | Path | ModelConfig, *, dtype: str, device: torch.device,
               seed: int = 0) -> tuple[ModelConfig, LlamaWeights]:
    """The config and weights the engine runs, from what its ``model`` argument names: a
    :class:`ModelConfig` or a preset name (seeded random weights), or a local directory."""
    if isinstance(model, ModelConfig):
        cfg = model.replace(dtype=dtype)
    elif isinstance(model, (str, Path)) and Path(model).is_dir():
        return load_hf_dir(model, dtype=dtype, device=device)
    elif isinstance(model, str):
        cfg = ModelConfig.preset(model).replace(dtype=dtype)
    else:
        raise InvalidArgument(f"model must be a ModelConfig, a preset name or a model directory, got {model!r}")
    return cfg, random_weights(cfg, seed=seed, dtype=dtype, device=device)
