"""`raytrain eval`: validation loss / perplexity of a checkpoint or exported model, spread over Ray tasks.

By default it evaluates exactly the sequences training's periodic validation used (the first
`data.eval_samples` of data.val, rounded to whole `num_workers x micro_batch` blocks), so the result
is comparable with the val_loss that training logged for the same checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Optional

import numpy as np
import torch

from raytrain import storage
from raytrain.errors import UserError


def eval_rows(split, n_samples: int, micro_batch: int, world: int) -> np.ndarray:
    """The rows training's Evaluator (raytrain.worker.evaluate) scores: the same count, the same order."""
    from raytrain.data.reader import read_rows

    block = world * micro_batch
    n = max(block, (min(n_samples, split.num_samples) // block) * block)
    return read_rows(split, 0, n)


def loss_sums(model: torch.nn.Module, rows: np.ndarray, micro_batch: int, *, window: Optional[int] = None,
              document_mask: bool = True) -> tuple[float, int]:
    """(sum of next-token cross entropy, number of predicted tokens) over rows of seq_len+1 tokens (window); rows of
    a fine-tuning split count their learned tokens only, with the training mask (raytrain/worker/loss.py)."""
    from raytrain.worker.loss import loss_sums as masked_sums

    model.eval()
    total, count = masked_sums(model, rows, micro_batch=micro_batch, window=window or rows.shape[1],
                               document_mask=document_mask)
    return total, int(round(count))


def _remote_loss(model_ref, rows: np.ndarray, micro_batch: int, kw: dict) -> tuple[float, int]:
    torch.set_num_threads(1)  # one CPU per task, as scheduled
    return loss_sums(model_ref, rows, micro_batch, **kw)


def distributed_loss(model: torch.nn.Module, rows: np.ndarray, micro_batch: int, workers: int,
                     **kw) -> tuple[float, int]:
    """Score rows on `workers` Ray tasks (contiguous micro-batch-aligned slices); sums come back to the driver.
    kw: loss_sums' window and document_mask."""
    import ray

    from raytrain.ray_connect import connect

    started = connect("eval", worker_logs=False)
    try:
        remote = ray.remote(num_cpus=1)(_remote_loss)
        model_ref = ray.put(model)
        per = math.ceil(len(rows) / micro_batch / workers) * micro_batch
        parts = [rows[i:i + per] for i in range(0, len(rows), per)]
        results = ray.get([remote.remote(model_ref, p, micro_batch, kw) for p in parts])
    finally:
        if started:
            ray.shutdown()
    return sum(r[0] for r in results), sum(r[1] for r in results)


def evaluate(checkpoint: Optional[str] = None, model_dir: Optional[str] = None, data: Optional[str] = None,
             samples: Optional[int] = None, workers: int = 2, log: Callable[[str], None] = print) -> dict:
    """Loss and perplexity of a checkpoint (or an exported model directory) on validation data."""
    from raytrain.data.manifest import load_split
    from raytrain.export import EXPORT_META, load_checkpoint, reported_val

    from raytrain.ray_connect import check_address

    if (checkpoint is None) == (model_dir is None):
        raise UserError("pass exactly one of --checkpoint URI or --model DIR")
    check_address("eval")  # before the model is loaded
    if checkpoint is not None:
        ck = load_checkpoint(checkpoint)
        model, cfg, step, reported = ck.model, ck.cfg, ck.step, reported_val(ck.uri.rsplit("/", 1)[0], ck.step)
        source = ck.uri
    else:
        from transformers import AutoModelForCausalLM

        from raytrain.config import Config
        from raytrain.model import local_model_dir

        local = local_model_dir(model_dir)
        meta_path = os.path.join(local, EXPORT_META)
        if not os.path.exists(meta_path) and data is None:
            raise UserError(f"{model_dir} was not exported by raytrain; pass --data <prepared val split>")
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        cfg = Config.model_validate(meta["config"]) if "config" in meta else None
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
        step, reported, source = meta.get("step"), meta.get("reported"), model_dir
    val_uri = data or (cfg.data.val if cfg else None)
    if not val_uri:
        raise UserError("the run had no data.val; pass --data <prepared val split>")
    split = load_split(val_uri, "--data" if data else "the run's data.val")
    cfg = cfg.largest() if cfg else None
    mb = cfg.batch.micro_batch_size if cfg else 8
    world = cfg.scaling.num_workers if cfg else 1
    rows = eval_rows(split, samples or (cfg.data.eval_samples if cfg else 512), mb, world)
    total, count = distributed_loss(model, rows, mb, max(1, workers), window=split.seq_len + 1,
                                    document_mask=cfg.data.document_mask if cfg else True)
    loss = total / count
    out = {"source": source, "step": step, "data": split.uri, "sequences": int(len(rows)), "tokens": count,
           "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "workers": workers}
    if reported and (data is None or storage.absolute(data) == storage.absolute(cfg.data.val)) and samples is None:
        out["reported_val_loss"] = reported["val_loss"]
        out["diff"] = loss - reported["val_loss"]
    log(f"[raytrain] {source} (step {step}) on {split.uri}: {len(rows)} sequences, val loss {loss:.6f}, "
        f"ppl {out['val_ppl']:.4f}" + (f" | training reported {out['reported_val_loss']:.6f} "
                                      f"(diff {out['diff']:+.2e})" if "diff" in out else ""))
    return out
