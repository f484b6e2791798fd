"""Validation loss and perplexity, spread over all ranks (each reads and evaluates its own slice; sums are all-reduced)."""

from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain.data.manifest import Split
from raytrain.data.reader import read_rows
from raytrain.worker.loss import loss_sums


def lm_loss(engine, rows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy: rows hold seq_len+1 tokens, the model sees the first seq_len."""
    logits = engine(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction=reduction)


class Evaluator:
    """Validation loss / perplexity on the first `data.eval_samples` sequences of val (collective)."""

    def __init__(self, data_cfg, *, split: Split, micro_batch: int, rank: int, world: int, device):
        n_samples, on_bad_shard = data_cfg.eval_samples, data_cfg.on_bad_shard
        # Every rank must run the same number of forward passes (ZeRO-3 gathers weights collectively),
        # so the evaluated set is a whole number of (world x micro_batch) blocks, and each rank reads only
        # its contiguous share of it: validation reads are 1/N per rank, never the whole set on every rank.
        block = world * micro_batch
        n = max(block, (min(n_samples, split.num_samples) // block) * block)
        share = n // world
        rows = read_rows(split, rank * share, (rank + 1) * share, on_bad_shard)
        # A skipped shard (on_bad_shard=skip) leaves a rank short: padding rows keep the forward passes in
        # step across ranks and are not counted.
        self.valid = len(rows)
        if len(rows) < share:
            rows = np.concatenate([rows, np.zeros((share - len(rows), split.row_width), np.int64)])
        self.rows = rows
        self.mb, self.device = micro_batch, device
        # Fine-tuning rows: only learned tokens count, with the training loss's document mask (worker/loss.py).
        self.window, self.document_mask = split.seq_len + 1, data_cfg.document_mask

    @torch.no_grad()
    def sums(self, engine) -> torch.Tensor:
        """[loss sum, tokens] over every rank's share (collective)."""
        engine.eval()
        total = torch.tensor(loss_sums(engine, self.rows, micro_batch=self.mb, window=self.window,
                                       document_mask=self.document_mask, valid=self.valid, device=self.device),
                             dtype=torch.float64)
        engine.train()
        if dist.is_initialized():
            total = total.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(total)
            total = total.cpu()
        return total

    def __call__(self, engine) -> tuple[float, float]:
        return _loss_ppl(self.sums(engine))

    def record(self, engine) -> dict:
        """The figures of one evaluation, as the run log names them, and its seconds (the goodput ledger's)."""
        t0 = time.perf_counter()
        loss, ppl = self(engine)
        return {"val_loss": loss, "val_ppl": ppl, "eval_s": round(time.perf_counter() - t0, 4)}


def _loss_ppl(total: torch.Tensor) -> tuple[float, float]:
    loss = (total[0] / total[1]).item() if total[1] else float("nan")
    return loss, math.exp(min(loss, 50.0))


class MixtureEvaluator:
    """A mixture's validation: val_loss/<name>, val_ppl/<name> per source with a val split, and the overall
    val_loss / val_ppl (data.val's when set, else all the sources' validation tokens pooled)."""

    def __init__(self, data_cfg, *, overall: Optional[Split], sources: dict, **kw):
        self.overall = Evaluator(data_cfg, split=overall, **kw) if overall else None
        self.parts = {name: Evaluator(data_cfg, split=Split.from_dict(d), **kw) for name, d in sources.items()}

    def record(self, engine) -> dict:
        t0 = time.perf_counter()
        rec, pooled = {}, torch.zeros(2, dtype=torch.float64)
        for name, ev in self.parts.items():
            total = ev.sums(engine)
            pooled += total
            rec[f"val_loss/{name}"], rec[f"val_ppl/{name}"] = _loss_ppl(total)
        rec["val_loss"], rec["val_ppl"] = self.overall(engine) if self.overall else _loss_ppl(pooled)
        rec["eval_s"] = round(time.perf_counter() - t0, 4)
        return rec


def evaluator_for(data_cfg, *, split: Optional[Split], sources: Optional[dict], **kw):
    """The run's evaluator (keywords: micro_batch, rank, world, device), or None when there is nothing to
    evaluate: per source when the mixture's sources have val splits, else on data.val."""
    if sources:
        return MixtureEvaluator(data_cfg, overall=split, sources=sources, **kw)
    return Evaluator(data_cfg, split=split, **kw) if split else None
