"""Model weights: seeded random init, or a local Hugging Face directory.

Weights are kept in the engine's own fused layout (:class:`LlamaWeights`): per layer one
``qkv`` matrix (q, k and v projections stacked) and one ``gate_up`` matrix, so a layer is
two matmuls for attention projections and two for the MLP. Nothing is ever downloaded:
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
from .config import ModelConfig

__all__ = ["LayerWeights", "LlamaWeights", "random_weights", "load_hf_dir", "torch_dtype"]


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


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

    def nbytes(self) -> int:
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            ts += [lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down]
        return sum(t.numel() * t.element_size() for t in ts)


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

    def norm() -> torch.Tensor:
        t = torch.empty(cfg.hidden_size, dtype=torch.float32, device=dev)
        t.uniform_(0.8, 1.2, generator=gen)
        return t.to(dt)

    h = cfg.hidden_size
    embed = torch.empty(cfg.vocab_size, h, dtype=torch.float32 if dev.type == "cpu" else dt, device=dev)
    embed.normal_(0.0, 1.0, generator=gen)
    embed = embed.to(dt)
    layers = [
        LayerWeights(attn_norm=norm(), qkv=mat(cfg.q_size + 2 * cfg.kv_size, h), o=mat(h, cfg.q_size),
                     mlp_norm=norm(), gate_up=mat(2 * cfg.intermediate_size, h),
                     down=mat(h, cfg.intermediate_size))
        for _ in range(cfg.num_layers)
    ]
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
    """Reads a local Hugging Face Llama directory (config.json + safetensors)."""
    from safetensors import safe_open

    p = Path(path)
    if not (p / "config.json").is_file():
        raise InvalidArgument(f"{p} is not a model directory (no config.json); nothing is downloaded")
    cfg = ModelConfig.from_hf_config(json.loads((p / "config.json").read_text()))
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

    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        q, k, v = (take(pre + f"self_attn.{n}_proj.weight") for n in "qkv")
        if q.shape != (cfg.q_size, cfg.hidden_size) or k.shape != (cfg.kv_size, cfg.hidden_size):
            raise InvalidArgument(f"layer {i}: q/k projection shapes {tuple(q.shape)}/{tuple(k.shape)} "
                                  "do not match config.json")
        layers.append(LayerWeights(
            attn_norm=put(take(pre + "input_layernorm.weight")),
            qkv=put(torch.cat([q, k, v], 0)),
            o=put(take(pre + "self_attn.o_proj.weight")),
            mlp_norm=put(take(pre + "post_attention_layernorm.weight")),
            gate_up=put(torch.cat([take(pre + "mlp.gate_proj.weight"), take(pre + "mlp.up_proj.weight")], 0)),
            down=put(take(pre + "mlp.down_proj.weight")),
        ))
    embed = put(take("model.embed_tokens.weight"))
    if "lm_head.weight" in tensors and not cfg.tie_word_embeddings:
        lm_head = put(take("lm_head.weight"))
    else:
        lm_head = embed
        cfg = cfg.replace(tie_word_embeddings=True)
    return cfg, LlamaWeights(embed=embed, layers=layers, norm=put(take("model.norm.weight")), lm_head=lm_head)
