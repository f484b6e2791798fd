"""Validation loss and perplexity, spread over all ranks (each evaluates its slice, sums are all-reduced)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain.data.manifest import Split
from raytrain.data.stream import SampleStream


def lm_loss(engine, rows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy: rows hold seq_len+1 tokens, the model sees the first seq_len."""
    logits = engine(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction=reduction)


class Evaluator:
    def __init__(self, split: Split, n_samples: int, micro_batch: int, rank: int, world: int, device, reader: str):
        # Every rank must run the same number of forward passes (ZeRO-3 gathers weights collectively),
        # so the evaluated set is a whole number of (world x micro_batch) blocks.
        block = world * micro_batch
        n = max(block, (min(n_samples, split.num_samples) // block) * block)
        rows = SampleStream(split, seed=0, shuffle=False, reader=reader).take(n)
        self.rows = rows[rank::world]
        self.mb, self.device = micro_batch, device

    @torch.no_grad()
    def __call__(self, engine) -> tuple[float, float]:
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(self.rows), self.mb):
            x = torch.from_numpy(np.ascontiguousarray(self.rows[i:i + self.mb])).to(self.device)
            total[0] += lm_loss(engine, x, reduction="sum").double().cpu()
            total[1] += x[:, 1:].numel()
        engine.train()
        if dist.is_initialized():
            total = total.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(total)
            total = total.cpu()
        loss = (total[0] / total[1]).item()
        return loss, math.exp(min(loss, 50.0))
