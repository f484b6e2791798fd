"""Builds the transformer from `model.*` config through `transformers` config classes; counts its FLOPs."""

from __future__ import annotations

from typing import Optional

import torch

from raytrain.config import ModelConfig


def hf_config(cfg: ModelConfig, vocab_size: int, eot_id: Optional[int] = None):
    """The `transformers` config object for our model section (random init; nothing from a hub)."""
    if cfg.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size, n_positions=cfg.seq_len, n_embd=cfg.hidden_size, n_layer=cfg.n_layer,
            n_head=cfg.n_head, n_inner=cfg.intermediate_size, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
            use_cache=False, bos_token_id=eot_id, eos_token_id=eot_id,
        )
    from transformers import LlamaConfig

    inter = cfg.intermediate_size or 256 * ((int(8 * cfg.hidden_size / 3) + 255) // 256)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=inter,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head or cfg.n_head, max_position_embeddings=cfg.seq_len,
        attention_dropout=cfg.dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False, bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=None,
    )


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, eot_id: Optional[int] = None) -> torch.nn.Module:
    """Same seed -> same initial weights on every rank and every restart."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, eot_id), attn_implementation=cfg.attn_implementation)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def param_count(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor: count unique storages, as the hardware sees them.
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def flops_per_token(n_params: int, cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6N for the weights plus attention's 12 * layers * hidden * seq_len (PaLM, App. B)."""
    return 6.0 * n_params + 12.0 * cfg.n_layer * cfg.hidden_size * cfg.seq_len
