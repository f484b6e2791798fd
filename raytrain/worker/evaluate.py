"""Validation loss and perplexity, spread over all ranks (each reads and evaluates its own slice; sums are all-reduced)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain.data.manifest import Split
from raytrain.data.reader import read_rows


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
            rows = np.concatenate([rows, np.zeros((share - len(rows), split.seq_len + 1), np.int64)])
        self.rows = rows
        self.mb, self.device = micro_batch, device

    @torch.no_grad()
    def __call__(self, engine) -> tuple[float, float]:
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(self.rows), self.mb):
            x = torch.from_numpy(np.ascontiguousarray(self.rows[i:i + self.mb])).to(self.device)
            losses = lm_loss(engine, x, reduction="none").view(len(x), -1)[:max(0, self.valid - i)]
            total[0] += losses.sum().double().cpu()
            total[1] += losses.numel()
        engine.train()
        if dist.is_initialized():
            total = total.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(total)
            total = total.cpu()
        loss = (total[0] / total[1]).item() if total[1] else float("nan")
        return loss, math.exp(min(loss, 50.0))
