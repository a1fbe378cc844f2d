"""Shared helpers of the engine tests: a tiny random Hugging Face Llama saved to disk."""

from __future__ import annotations

import torch

TINY_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-5, initializer_range=0.3, eos_token_id=2, bos_token_id=1)


def make_hf_model(tmp_path, *, rope=None, tie=False, shard=None, seed=0, **over):
    import transformers

    kw = dict(TINY_HF, tie_word_embeddings=tie, **over)
    if rope is not None:
        kw["rope_parameters"] = rope
    cfg = transformers.LlamaConfig(**kw)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from one, so a missing norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
    save = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **save)
    return model


def hf_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def saved_blocks(e, rid, n_tokens):
    """Every block of request ``rid`` (``n_tokens`` of KV) saved into its own buffer, in
    order: what an instance would hand another as ``restored_kv`` / ``kv_blocks``."""
    import numpy as np

    bufs = []
    for i in range(-(-n_tokens // e.block_size)):
        buf = np.zeros(e.layout.block_nbytes, dtype=np.uint8)
        e.save_block(rid, i, buf)
        bufs.append(buf)
    return bufs
