"""Checkpoint -> Hugging Face model: consolidate any ZeRO stage's weights and write a model directory.

The directory (config.json, model.safetensors, tokenizer files, generation_config.json and our
raytrain_export.json) loads offline with stock `AutoModelForCausalLM` / `AutoTokenizer`. DeepSpeed's
own zero_to_fp32 does the consolidation (ZeRO-1/2 fp32 master weights, ZeRO-3 parameter shards).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import yaml

from raytrain import lineage, storage
from raytrain.audit import run_event
from raytrain.rundir import METRICS, SUMMARY, RunDir
from raytrain.ckpt import catalog
from raytrain.ckpt.layout import CONFIG, ENGINE_TAG, timestamp
from raytrain.config import Config
from raytrain.errors import UserError
from raytrain.serving.openai_api import DEFAULT_CHAT_TEMPLATE

EXPORT_META = "raytrain_export.json"


@dataclass
class LoadedCheckpoint:
    model: torch.nn.Module
    cfg: Config
    step: int
    uri: str
    eot_id: int
    tokenizer_uri: Optional[str]
    dtype: Optional[str] = None  # the precision the run trained in, where its checkpoint records it


def checkpoint_config(ckpt_uri: str) -> Config:
    """The resolved config saved inside a checkpoint."""
    info = catalog.verify(ckpt_uri)
    if not info.complete:
        raise UserError(f"checkpoint {ckpt_uri} is not complete ({info.reason}); pick one from `raytrain ckpt list`")
    return Config.model_validate(yaml.safe_load(storage.read_text(storage.join(ckpt_uri, CONFIG))))


def consolidated_state_dict(ckpt_uri: str, zero_stage: int, tensor_parallel: int = 1) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint's engine state, whatever the ZeRO stage, world and tensor-parallel size."""
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as d:
        storage.download_dir(storage.join(ckpt_uri, ENGINE_TAG), os.path.join(d, ENGINE_TAG))
        if tensor_parallel > 1:
            return _merged_tensor_parallel(os.path.join(d, ENGINE_TAG), os.path.join(d, "universal"))
        if zero_stage == 0:  # plain data parallel: rank 0's module state is the whole model
            states = torch.load(os.path.join(d, ENGINE_TAG, "mp_rank_00_model_states.pt"), map_location="cpu",
                                weights_only=False)
            return {k: v.float() for k, v in states["module"].items()}
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # It prints every tensor it merges, and draws a "Loading checkpoint shards" bar on stderr: neither is for a
        # user (an error still raises).
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(d, tag=ENGINE_TAG)


def _merged_tensor_parallel(engine_dir: str, out_dir: str) -> dict[str, torch.Tensor]:
    """AutoTP checkpoints hold one slice of each sharded weight per tensor-parallel rank, which zero_to_fp32 does
    not merge; DeepSpeed's universal-checkpoint converter does (it records how each weight was split)."""
    from raytrain.ckpt.reshard import to_universal

    to_universal(engine_dir, out_dir)
    zero = os.path.join(out_dir, "zero")
    return {name: torch.load(os.path.join(zero, name, "fp32.pt"), map_location="cpu", weights_only=False)["param"].float()
            for name in os.listdir(zero) if os.path.exists(os.path.join(zero, name, "fp32.pt"))}


def load_checkpoint(ckpt_uri: str, tokenizer: Optional[str] = None, merge: bool = True) -> LoadedCheckpoint:
    """The trained model of a checkpoint as a plain `transformers` model (fp32, eval mode). A LoRA checkpoint's
    adapter is merged into its base (merge=False: the peft model, adapter apart)."""
    from transformers import AutoModelForCausalLM

    from raytrain.data.manifest import load_split
    from raytrain.model import hf_config

    ckpt_uri = storage.absolute(ckpt_uri)
    cfg = checkpoint_config(ckpt_uri)
    state = json.loads(storage.read_text(storage.join(ckpt_uri, "raytrain_state.json")))
    step = state["step"]
    sd = consolidated_state_dict(ckpt_uri, cfg.deepspeed.zero_stage, cfg.deepspeed.tensor_parallel_size)
    emb = [v for k, v in sd.items() if k.endswith(("wte.weight", "embed_tokens.weight"))]
    if not emb and not cfg.model.lora.r:
        raise UserError(f"{ckpt_uri}: no token embedding among the saved weights; is it a raytrain checkpoint?")
    eot_id, tok_uri, vocab = None, tokenizer, cfg.model.vocab_size or (emb[0].shape[0] if emb else None)
    from raytrain.data.sources import train_uri

    train = train_uri(cfg.data)  # a mixture: its first source (every source shares one tokenizer)
    if train:
        try:
            split = load_split(train, "the checkpoint's data.train")
            eot_id, tok_uri = split.eot_id, tokenizer or split.tokenizer_uri
            vocab = vocab or split.vocab_size
        except UserError:
            beside = storage.join(storage.absolute(train).rsplit("/", 1)[0], "tokenizer.json")
            if tokenizer is None and storage.exists(beside):  # `prepare` writes it next to the splits
                tok_uri = beside
            elif tokenizer is None:
                raise UserError(f"the tokenizer of {ckpt_uri} is beside its training data ({train}), which "
                                f"is not reachable; pass --tokenizer <tokenizer.json>") from None
    if eot_id is None and tok_uri:
        eot_id = _eot_of(tok_uri)
    if cfg.model.lora.r:
        from raytrain import lora

        model = lora.from_checkpoint(cfg, sd, vocab=vocab, eot_id=eot_id, saved=state.get("lora_base"),
                                     where=ckpt_uri, merge=merge)
        return LoadedCheckpoint(model, cfg, step=step, uri=ckpt_uri, eot_id=eot_id, tokenizer_uri=tok_uri,
                                dtype=state.get("dtype"))
    model_cfg = cfg.model.model_copy(update={"init_from": None})
    model = AutoModelForCausalLM.from_config(hf_config(model_cfg, emb[0].shape[0], eot_id),
                                             attn_implementation=cfg.model.attn_implementation)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise UserError(f"{ckpt_uri}: saved weights do not fit the configured model (missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    model.eval()
    return LoadedCheckpoint(model, cfg, step=step, uri=ckpt_uri, eot_id=eot_id, tokenizer_uri=tok_uri,
                            dtype=state.get("dtype"))


def _eot_of(tokenizer_uri: str) -> Optional[int]:
    from tokenizers import Tokenizer

    from raytrain.data.prepare import EOT

    return Tokenizer.from_str(storage.read_text(tokenizer_uri)).token_to_id(EOT)


def hf_tokenizer(tokenizer_uri: str, max_length: int, eot_id: Optional[int]):
    """Our tokenizers-library tokenizer.json as a `transformers` fast tokenizer (the dataset's end-of-text
    token as bos/eos/pad)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from raytrain.data.prepare import EOT

    text = storage.read_text(tokenizer_uri)
    eot = Tokenizer.from_str(text).id_to_token(eot_id) if eot_id is not None else EOT
    with tempfile.TemporaryDirectory(prefix="raytrain-tok-") as d:
        path = os.path.join(d, "tokenizer.json")
        with open(path, "w") as f:
            f.write(text)
        return PreTrainedTokenizerFast(tokenizer_file=path, bos_token=eot, eos_token=eot, pad_token=eot,
                                       model_max_length=max_length)


def write_model_dir(ck: LoadedCheckpoint, model, d: str, *, params: int, **extra) -> dict:
    """A model's weights, tokenizer, generation config and export metadata into local directory d; the metadata."""
    from transformers import GenerationConfig

    model.config.use_cache = True  # training turned the KV cache off; generation wants it
    model.save_pretrained(d)
    tok = hf_tokenizer(ck.tokenizer_uri, ck.cfg.model.seq_len, ck.eot_id)
    tok.chat_template = DEFAULT_CHAT_TEMPLATE  # so /v1/chat/completions and offline chat render alike
    tok.save_pretrained(d)
    GenerationConfig(bos_token_id=ck.eot_id, eos_token_id=ck.eot_id, pad_token_id=ck.eot_id).save_pretrained(d)
    meta = {"source_checkpoint": ck.uri, "step": ck.step, "params": params, "family": ck.cfg.model.family,
            "zero_stage": ck.cfg.deepspeed.zero_stage, "seq_len": ck.cfg.model.seq_len,
            "reported": reported_val(ck.uri.rsplit("/", 1)[0], ck.step), "val_data": ck.cfg.data.val,
            "exported": timestamp(), "config": ck.cfg.to_dict(), **extra}
    with open(os.path.join(d, EXPORT_META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def reported_val(run_uri: str, step: int) -> Optional[dict]:
    """The validation loss / perplexity training logged at `step` (metrics.jsonl), if it evaluated then."""
    found = None
    for rec in RunDir(run_uri).read_jsonl(METRICS):
        if rec.get("step") == step and "val_loss" in rec:
            found = {"val_loss": rec["val_loss"], "val_ppl": rec.get("val_ppl")}
    return found


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_dtype(ck: LoadedCheckpoint, asked: Optional[str]) -> str:
    """The weights' precision in an export: as asked, else the one the run trained in (recorded in its checkpoints;
    before that was recorded: precision.dtype, and `auto` on a GPU run taken as bf16, on CPU fp32)."""
    if asked is not None:
        if asked not in DTYPES:
            raise UserError(f"--dtype {asked!r}: use one of {', '.join(DTYPES)}")
        return asked
    if ck.dtype:
        return ck.dtype
    d = ck.cfg.precision.dtype
    return d if d != "auto" else ("bf16" if ck.cfg.scaling.use_gpu else "fp32")


def export(ckpt_uri: str, out_uri: str, tokenizer: Optional[str] = None, force: bool = False,
           log: Callable[[str], None] = print, adapter: bool = False, dtype: Optional[str] = None) -> dict:
    """Write a Hugging Face model directory for a checkpoint, its weights in `dtype` (default: the precision the run
    trained in: export_dtype); checks the parameter count on reload. A LoRA checkpoint's adapter is merged in;
    adapter=True writes the PEFT adapter directory instead (raytrain/lora.py)."""
    from transformers import AutoModelForCausalLM

    from raytrain.model import param_count

    out_uri = storage.absolute(out_uri)
    if any(storage.exists(storage.join(out_uri, f)) for f in ("config.json", "adapter_config.json")) and not force:
        raise UserError(f"{out_uri} already holds a model; pass --force to overwrite it")
    if adapter:
        if dtype is not None:
            raise UserError("--dtype applies to a merged export; an adapter is written in the precision it trained in")
        return export_adapter(ckpt_uri, out_uri, tokenizer=tokenizer, log=log)
    ck = load_checkpoint(ckpt_uri, tokenizer)
    if ck.tokenizer_uri is None:
        raise UserError(f"no tokenizer known for {ck.uri}; pass --tokenizer <tokenizer.json>")
    n_params = param_count(ck.model)
    run_uri = ck.uri.rsplit("/", 1)[0]
    trained = (RunDir(run_uri).read_json(SUMMARY) or {}).get("params")
    if trained is not None and trained != n_params:
        raise UserError(f"parameter count {n_params:,} differs from the {trained:,} the run trained "
                        f"({RunDir(run_uri).uri(SUMMARY)})")
    precision = export_dtype(ck, dtype)
    ck.model.to(getattr(torch, DTYPES[precision]))
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as d:
        write_model_dir(ck, ck.model, d, params=n_params, dtype=precision)
        lin = lineage.build(ck.uri, tokenizer)  # lineage.json: where the model came from (raytrain/lineage.py)
        lineage.write(d, lin)  # last: it lists every file's sha256
        # The release gate in miniature: what we wrote must load with stock transformers and be the same size.
        reloaded = param_count(AutoModelForCausalLM.from_pretrained(d))
        if reloaded != n_params:
            raise UserError(f"exported model has {reloaded:,} parameters after reload, expected {n_params:,}")
        files = sorted(os.listdir(d))
        storage.upload_dir(d, out_uri)
    run_event(run_uri, "export", checkpoint=ck.uri, step=ck.step, out=out_uri, params=n_params, lineage=lin["id"],
              adapter=False)
    log(f"[raytrain] exported {ck.uri} (step {ck.step}, ZeRO-{ck.cfg.deepspeed.zero_stage}) -> {out_uri}: "
        f"{n_params:,} parameters in {precision} (checked on reload), lineage {lin['id']}, files: {', '.join(files)}")
    return {"out": out_uri, "step": ck.step, "params": n_params, "files": files, "lineage": lin["id"],
            "dtype": precision}


def export_adapter(ckpt_uri: str, out_uri: str, *, tokenizer: Optional[str], log) -> dict:
    """`raytrain export --adapter`: the PEFT adapter directory of a LoRA checkpoint (stock `peft` loads it onto its
    base), with the tokenizer and export metadata; the base is model.init_from, or written into base/ beside it."""
    from raytrain.lora import BASE_DIR
    from raytrain.model import local_model_dir, param_count

    ck = load_checkpoint(ckpt_uri, tokenizer, merge=False)
    if not hasattr(ck.model, "peft_config"):
        raise UserError(f"--adapter: {ck.uri} was not trained with model.lora (r > 0); export it without --adapter")
    if ck.tokenizer_uri is None:
        raise UserError(f"no tokenizer known for {ck.uri}; pass --tokenizer <tokenizer.json>")
    n_adapter = sum(p.numel() for n, p in ck.model.named_parameters() if "lora_" in n)
    with tempfile.TemporaryDirectory(prefix="raytrain-export-") as d:
        init_from = ck.cfg.model.init_from
        ck.model.peft_config["default"].base_model_name_or_path = \
            os.path.abspath(local_model_dir(init_from)) if init_from else BASE_DIR
        ck.model.save_pretrained(d)  # adapter_config.json + adapter_model.safetensors
        base = ck.model.unload()  # the frozen base, without the adapter layers
        write_model_dir(ck, base, d, params=param_count(base), adapter_params=n_adapter)
        for f in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(os.path.join(d, f))  # the base's, written by write_model_dir: they live in base/ (or init_from)
        if not init_from:
            write_model_dir(ck, base, os.path.join(d, BASE_DIR), params=param_count(base))
        lin = lineage.build(ck.uri, tokenizer)
        lineage.write(d, lin)  # last: it lists every file's sha256
        files = sorted(os.listdir(d))
        storage.upload_dir(d, out_uri)
    run_event(ck.uri.rsplit("/", 1)[0], "export", checkpoint=ck.uri, step=ck.step, out=out_uri, params=n_adapter,
              lineage=lin["id"], adapter=True)
    log(f"[raytrain] exported the LoRA adapter of {ck.uri} (step {ck.step}) -> {out_uri}: {n_adapter:,} adapter "
        f"parameters, base {'model.init_from ' + init_from if init_from else BASE_DIR + '/'}, lineage {lin['id']}; "
        f"files: {', '.join(files)}")
    return {"out": out_uri, "step": ck.step, "adapter_params": n_adapter, "files": files, "lineage": lin["id"]}
