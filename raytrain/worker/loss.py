"""Masked next-token cross entropy for fine-tuning rows (tokens | loss_mask | segment_ids), normalised over the learned
tokens of the whole global batch, and the document mask that keeps packed examples apart.

Why the global count: a mean per micro-batch (or per rank) weighs a token by how many learned tokens happen to
share its micro-batch, so the loss and its gradient would change with gradient accumulation and the number of
workers. Dividing every rank's sum by the all-reduced count of learned tokens makes the optimizer step the
gradient of one quantity, the mean over all learned tokens of the global batch, whatever the split.
DeepSpeed divides each backward by the accumulation steps and averages gradients over data-parallel ranks, so a
micro-batch's loss is passed as sum x accumulation x data-parallel size / global count.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raytrain.worker.linear_ce import chunked_head, hidden_out, linear_cross_entropy


def is_example_rows(rows, window: int) -> bool:
    """Rows of a fine-tuning split (three columns side by side) rather than plain token windows."""
    return rows.shape[-1] == 3 * window


def learned_weight(rows: torch.Tensor, window: int) -> torch.Tensor:
    """[b, window - 1] 1.0 where target j + 1 is learned: its mask is 1 and it lies in the same example as input j
    (the first token of the next packed example is never predicted from this one)."""
    mask, seg = rows[:, window:2 * window], rows[:, 2 * window:]
    return ((mask[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).float()


def document_inputs(seg: torch.Tensor) -> dict:
    """position_ids restarting at 0 at every example and a boolean [b, 1, q, k] attention mask: causal and inside one
    example (padding, segment 0, attends to padding only), for transformers' 4D-mask path (SDPA / eager)."""
    b, n = seg.shape
    idx = torch.arange(n, device=seg.device).expand(b, n)
    change = torch.ones_like(seg, dtype=torch.bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = torch.cummax(torch.where(change, idx, torch.zeros_like(idx)), dim=1).values
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=seg.device))
    mask = causal & (seg[:, :, None] == seg[:, None, :])
    return {"position_ids": idx - start, "attention_mask": mask[:, None]}


def _targets(rows: torch.Tensor, *, window: int, document_mask: bool) -> tuple[torch.Tensor, torch.Tensor, dict,
                                                                               torch.Tensor]:
    """(input ids, targets, extra model inputs, weight per target [b, window - 1]): weight 1 everywhere for text
    rows, the loss mask for example rows (whose attention stays inside each example with document_mask)."""
    if not is_example_rows(rows, window):
        return rows[:, :-1], rows[:, 1:], {}, torch.ones(len(rows), window - 1, device=rows.device)
    tok = rows[:, :window]
    extra = document_inputs(rows[:, 2 * window:3 * window - 1]) if document_mask else {}
    return tok[:, :-1], tok[:, 1:], extra, learned_weight(rows, window)


def token_losses(model, rows: torch.Tensor, *, window: int, document_mask: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross entropy per target [b, window - 1], weight per target), through the whole logits."""
    ids, targets, extra, weight = _targets(rows, window=window, document_mask=document_mask)
    return cross_entropy(model(input_ids=ids, **extra).logits, targets), weight


def weighted_loss(model, ids: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, extra: dict) -> torch.Tensor:
    """sum(weight x cross entropy), fp32: chunk by chunk when the model takes the chunked loss (worker/linear_ce.py;
    no [tokens, vocab] logits), else through the whole logits."""
    head = chunked_head(model)
    if head is None:
        return (cross_entropy(model(input_ids=ids, **extra).logits, targets) * weight).sum()
    with hidden_out(head):
        hidden = model(input_ids=ids, **extra).logits
    return linear_cross_entropy(hidden, head.weight, targets, weight, bias=head.bias)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[b, n] cross entropy of next-token logits [b, n, vocab] against targets [b, n], in fp32."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return ce.view(targets.shape)


class StepLoss:
    """The training loss of one optimizer step. Text rows: today's mean cross entropy per micro-batch. Example rows:
    `begin(rows)` all-reduces the step's learned-token count (one collective per step); `__call__` gives each
    micro-batch's share of the global masked mean, scaled for DeepSpeed's averaging (module docstring)."""

    def __init__(self, data_cfg, *, window: int, accumulation: int, world: int, dp_size: int, device,
                 reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.window, self.document_mask = window, data_cfg.document_mask
        self.acc, self.world, self.dp_size, self.device = accumulation, world, dp_size, device
        self.reduce = reduce or _all_reduce  # the sum of a count over the world's ranks
        self.scale: Optional[float] = None

    def begin(self, rows: np.ndarray) -> None:
        """This rank's rows of the global batch (all its micro-batches)."""
        if not is_example_rows(rows, self.window):
            self.scale = None
            return
        w = self.window
        mask, seg = rows[:, w + 1:2 * w], rows[:, 2 * w:]
        n = torch.tensor([float(((mask > 0) & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).sum())],
                         dtype=torch.float64, device=self.device)
        n = self.reduce(n) if self.world > 1 else n
        # Tensor-parallel ranks hold the same rows: the world's sum counts each data-parallel slice that many times.
        n_global = float(n.item()) * self.dp_size / self.world
        self.scale = self.acc * self.dp_size / max(n_global, 1.0)

    def __call__(self, engine, x: torch.Tensor) -> torch.Tensor:
        ids, targets, extra, weight = _targets(x, window=self.window,
                                               document_mask=self.document_mask and self.scale is not None)
        # text rows: the micro-batch's mean; example rows: its share of the global batch's masked mean
        weight = weight / weight.numel() if self.scale is None else weight * self.scale
        return weighted_loss(engine, ids, targets, weight, extra)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


@torch.no_grad()
def loss_sums(model, rows: np.ndarray, *, micro_batch: int, window: int, document_mask: bool,
              valid: Optional[int] = None, device=None) -> tuple[float, float]:
    """(sum of the cross entropy over learned targets, their count) over rows, `valid` first rows counted: the
    validation loss and perplexity with the training mask."""
    total, count = 0.0, 0.0
    valid = len(rows) if valid is None else valid
    for i in range(0, len(rows), micro_batch):
        x = torch.from_numpy(np.array(rows[i:i + micro_batch], dtype=np.int64))
        x = x.to(device) if device is not None else x
        ids, targets, extra, weight = _targets(x, window=window, document_mask=document_mask)
        weight[max(0, valid - i):] = 0.0  # padding rows are not counted
        total += float(weighted_loss(model, ids, targets, weight, extra))
        count += float(weight.double().sum())
    return total, count
