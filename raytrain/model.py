"""Builds the transformer from `model.*` config through `transformers` config classes; counts its FLOPs."""

from __future__ import annotations

import contextlib
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
    from transformers import LlamaConfig, MixtralConfig

    inter = cfg.intermediate_size or 256 * ((int(8 * cfg.hidden_size / 3) + 255) // 256)
    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=inter,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head or cfg.n_head, max_position_embeddings=cfg.seq_len,
        attention_dropout=cfg.dropout, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False, bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=None,
    )
    if cfg.family == "mixtral":
        # output_router_logits: the forward returns the router's load-balancing loss (aux_loss), which
        # the training loop adds to the LM loss with moe_aux_loss_coef and logs.
        return MixtralConfig(**common, num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                             router_aux_loss_coef=cfg.moe_aux_loss_coef, output_router_logits=True)
    return LlamaConfig(**common)


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, eot_id: Optional[int] = None,
                ds_config: Optional[dict] = None, *, init: bool = True) -> torch.nn.Module:
    """Same seed -> same initial weights on every rank and every restart.

    `init=False` leaves a new model's weights as allocated, for a caller that overwrites every one of them (a
    restore): random initialisation is the slowest part of building a large model (under ZeRO-3 each layer is
    gathered to be initialised). Buffers are computed at construction either way, and `init_from` loads its weights.

    With the run's DeepSpeed config (`ds_config`) no rank holds more than it trains with: under ZeRO-3 the model
    is built inside `deepspeed.zero.Init` (transformers' DeepSpeed integration), each layer partitioned across
    the ranks as it is created and `init_from` weights loaded straight into the partitions; under ZeRO-0/1/2 it
    is built in the training dtype, so DeepSpeed's cast makes no second copy. Without it (or without a process
    group): fp32, whole.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    dtype, keep = training_dtype(ds_config), None
    # AutoTP slices whole weights inside deepspeed.initialize, so a tensor-parallel run is built whole.
    if (ds_config is not None and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3
            and "tensor_parallel" not in ds_config and torch.distributed.is_initialized()):
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init partitions over DeepSpeed's view of the process group: wrap the one Ray Train set up (as
        # deepspeed.initialize would, later).
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=False)

        # transformers looks this object up through a weak reference: while it lives, from_config and
        # from_pretrained build under zero.Init with this very config, so partitions go straight to the ranks.
        keep = HfDeepSpeedConfig(ds_config)
    if cfg.init_from:  # fine-tuning: the weights (and shape) of a Hugging Face model directory
        drop = ({"resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout}
                if cfg.family == "gpt2" else {"attention_dropout": cfg.dropout})
        model = AutoModelForCausalLM.from_pretrained(local_model_dir(cfg.init_from), dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation, **drop)
        model.config.use_cache = False
    else:
        from transformers.initialization import no_init_weights

        with contextlib.nullcontext() if init else no_init_weights():
            model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size, eot_id), dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
        if not init:
            model.tie_weights()  # transformers' init_weights both initialises and ties; no_init_weights skips both
    if keep is not None:
        model.raytrain_hf_ds_config = keep  # transformers' later ZeRO-3 paths (e.g. generate) need it alive too
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.family == "mixtral":
        model.register_forward_hook(_keep_aux_loss)
    return model


def training_dtype(ds_config: Optional[dict]) -> torch.dtype:
    """The dtype DeepSpeed trains the weights in under this config (fp32 without one)."""
    ds_config = ds_config or {}
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def compiles(cfg: ModelConfig, cuda: bool) -> bool:
    """model.compile with auto resolved: on GPU workers, not with LoRA adapters."""
    return cfg.compile is True or (cfg.compile == "auto" and cuda and cfg.lora.r <= 0)


def compile_engine(engine, cfg: ModelConfig, *, cuda: bool, zero_stage: int) -> str:
    """model.compile: torch.compile in place, so parameter names - and with them checkpoints - are the same as
    without it. Block by block (torchtitan's way): the blocks are alike, so one compilation serves them all and
    the first step waits seconds, not minutes. Under ZeRO-3 the whole model through DeepSpeed's engine.compile,
    which knows its parameter-gathering hooks. Returns what was compiled ("" for nothing)."""
    if not compiles(cfg, cuda):
        return ""
    if zero_stage == 3:
        engine.compile()
        return "model"
    blocks = transformer_blocks(engine.module)
    for block in blocks:
        block.compile()
    return f"{len(blocks)} blocks"


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder blocks (GPT-2's transformer.h, Llama's / Mixtral's model.layers)."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise RuntimeError(f"no list of {n} decoder blocks in {type(model).__name__}")


def _keep_aux_loss(module, args, output) -> None:
    module.raytrain_aux_loss = output.aux_loss


def moe_aux_loss(module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The router's load-balancing loss of the module's latest forward (MoE families), else None.

    Kept by a forward hook, so the loss function and the engine stay family-agnostic.
    """
    return getattr(module, "raytrain_aux_loss", None)


def local_model_dir(uri: str) -> str:
    """A Hugging Face model directory as a local path: s3:// ones are downloaded once per process."""
    from raytrain import storage

    if not storage.is_remote(uri):
        return storage.absolute(uri)
    if uri not in _DOWNLOADED:
        import tempfile

        _DOWNLOADED[uri] = storage.download_dir(uri, tempfile.mkdtemp(prefix="raytrain-model-"))
    return _DOWNLOADED[uri]


_DOWNLOADED: dict[str, str] = {}

# Our model.* fields as named in each family's Hugging Face config.
_HF_FIELDS = {
    "gpt2": {"n_layer": "n_layer", "hidden_size": "n_embd", "n_head": "n_head", "intermediate_size": "n_inner",
             "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings"},
    "llama": {"n_layer": "num_hidden_layers", "hidden_size": "hidden_size", "n_head": "num_attention_heads",
              "n_kv_head": "num_key_value_heads", "intermediate_size": "intermediate_size",
              "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings"},
}
_HF_FIELDS["mixtral"] = {**_HF_FIELDS["llama"], "moe_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok"}


def apply_init_from(cfg, train_tokenizer_uri: str, log=print):
    """Driver side, before workers start: a fine-tuning run takes its model shape from the init_from
    model's config.json, and its data must have been tokenized with that model's tokenizer."""
    import json

    from raytrain import storage
    from raytrain.errors import UserError

    src = cfg.model.init_from
    if not src:
        return cfg
    src = storage.absolute(src)
    curi = storage.join(src, "config.json")
    if not storage.exists(curi):
        raise UserError(f"model.init_from={src}: no config.json there; point it at a Hugging Face model "
                        f"directory (e.g. the --out of `raytrain export`)")
    hf = json.loads(storage.read_text(curi))
    family = hf.get("model_type")
    if family not in _HF_FIELDS:
        raise UserError(f"model.init_from={src} is a {family!r} model; raytrain fine-tunes {', '.join(_HF_FIELDS)} models")
    update = {"family": family, "init_from": src}
    for ours, theirs in _HF_FIELDS[family].items():
        if theirs in hf and ours in type(cfg.model).model_fields:
            update[ours] = hf[theirs]
    limit = hf.get("n_positions") or hf.get("max_position_embeddings")
    if limit and cfg.model.seq_len > limit:
        raise UserError(f"model.seq_len={cfg.model.seq_len} exceeds model.init_from's context of {limit} tokens; "
                        f"prepare the data with seq_len<={limit}")
    tok_uri = storage.join(src, "tokenizer.json")
    if storage.exists(tok_uri):
        from tokenizers import Tokenizer

        theirs = Tokenizer.from_str(storage.read_text(tok_uri)).get_vocab()
        ours = Tokenizer.from_str(storage.read_text(train_tokenizer_uri)).get_vocab()
        if theirs != ours:
            raise UserError(f"data.train was tokenized with {train_tokenizer_uri}, not with model.init_from's "
                            f"tokenizer; prepare it again with tokenizer={tok_uri}")
    changed = {k: v for k, v in update.items() if getattr(cfg.model, k) != v and k != "init_from"}
    if changed:
        log(f"[raytrain] model.init_from={src}: model shape from its config.json: "
            + ", ".join(f"model.{k}={v}" for k, v in changed.items()))
    model = cfg.model.model_validate({**cfg.model.model_dump(), **update})
    return cfg.model_copy(update={"model": model})


def param_count(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor: count unique storages, as the hardware sees them.
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += numel(p)
    return n


def numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also of a ZeRO-3 partitioned one (whose local tensor is empty)."""
    return getattr(p, "ds_numel", None) or p.numel()


def param_counts(model: torch.nn.Module, cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of a built model: a Mixture-of-Experts token runs through top_k of
    the experts, so FLOPs (the planner's and the training loop's MFU) follow the active count, memory the total."""
    total = param_count(model)
    if cfg.family != "mixtral":
        return total, total
    expert = sum(numel(p) for name, p in model.named_parameters() if ".experts." in name or name.endswith(".experts"))
    return total, total - expert + expert * cfg.moe_top_k // cfg.moe_experts


def flops_per_token(n_params: int, cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6N for the weights plus attention's 12 * layers * hidden * seq_len (PaLM, App. B)."""
    return 6.0 * n_params + 12.0 * cfg.n_layer * cfg.hidden_size * cfg.seq_len


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # No decay on biases, norms and embeddings' 1-D params: the usual GPT recipe.
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)  # ds_shape: ZeRO-3
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
