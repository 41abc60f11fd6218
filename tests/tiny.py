"""Tiny random decoders for structure tests (never for accuracy claims)."""

from __future__ import annotations

import torch


def tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, vocab=128, positions=512, seed=0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        attn_implementation=kw.pop("attn_implementation", "sdpa"),
        eos_token_id=kw.pop("eos_token_id", None),  # random weights: never stop early
        **kw,
    )
    return LlamaForCausalLM(cfg).eval()


def prompt(length: int, vocab: int = 128, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def generate(model, ids, new_tokens=6, backend=None, **kw):
    """Greedy generate, eagerly or through torch.compile with ``backend``; restores ``forward``."""
    fwd = model.forward
    if backend is not None:
        model.forward = torch.compile(fwd, backend=backend)
    try:
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    finally:
        model.forward = fwd
