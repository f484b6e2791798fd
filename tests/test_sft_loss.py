"""The fine-tuning loss (raytrain/worker/loss.py) without Ray: the masked mean over the learned tokens of the whole
global batch, whatever the workers and accumulation (DeepSpeed's averaging simulated exactly), masked targets
without effect, and the document mask keeping packed examples apart."""

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raytrain.config import DataConfig, ModelConfig
from raytrain.data.examples import pack
from raytrain.model import build_model
from raytrain.worker.loss import StepLoss, cross_entropy, document_inputs, learned_weight, token_losses

W = 17  # window: seq_len 16 + 1
VOCAB = 50


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(family="llama", seq_len=16, hidden_size=16, n_head=2, n_layer=1), VOCAB, 0).eval()


def _rows(n_examples=40, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ex = []
    for _ in range(n_examples):
        p, c = rng.integers(1, 6), rng.integers(1, 6)
        ex.append((rng.integers(1, VOCAB, p + c).astype(np.int32),
                   np.concatenate([np.zeros(p, np.uint8), np.ones(c, np.uint8)])))
    rows = pack(ex, window=W, packed=True, too_long="truncate", pad_id=0, counts=Counter())
    return rows.reshape(len(rows), 3 * W).astype(np.int64)


def _step(model, rows: np.ndarray, *, world: int, acc: int, document_mask=True):
    """(logged loss, gradients) of one step as the training loop and DeepSpeed compute them: each rank's micro-batch
    losses, backward divided by accumulation, gradients averaged over ranks, logged loss averaged over ranks."""
    model.zero_grad()
    gb = len(rows)
    per, mb = gb // world, gb // world // acc
    total = float(learned_weight(torch.from_numpy(rows), W).sum())
    cfg = DataConfig(document_mask=document_mask)
    logged = 0.0
    for r in range(world):
        mine = rows[r * per:(r + 1) * per]
        loss = StepLoss(cfg, window=W, accumulation=acc, world=world, dp_size=world, device=torch.device("cpu"),
                        reduce=lambda n: torch.tensor([total], dtype=torch.float64))
        loss.begin(mine)
        for a in range(acc):
            x = loss(model, torch.from_numpy(mine[a * mb:(a + 1) * mb]))
            (x / acc / world).backward()
            logged += x.item() / acc / world
    return logged, [p.grad.clone() for p in model.parameters()]


def test_loss_is_the_global_masked_mean_at_any_workers_and_accumulation(model):
    rows = _rows()[:16]
    base_loss, base_grads = _step(model, rows, world=1, acc=1)
    t = torch.from_numpy(rows)
    logits = model(input_ids=t[:, :W - 1], **document_inputs(t[:, 2 * W:3 * W - 1])).logits
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), t[:, 1:W].reshape(-1), reduction="none")
    w = learned_weight(t, W).reshape(-1)
    assert abs(base_loss - float((ce * w).sum().detach() / w.sum())) < 1e-6  # by hand
    for world, acc in ((1, 4), (2, 1), (2, 2), (4, 1)):
        loss, grads = _step(model, rows, world=world, acc=acc)
        assert abs(loss - base_loss) < 1e-6, (world, acc)
        assert max(float((g - b).abs().max()) for g, b in zip(grads, base_grads)) < 1e-6, (world, acc)


def test_masked_targets_change_neither_loss_nor_gradients(model):
    t = torch.from_numpy(_rows()[:8])
    logits = model(input_ids=t[:, :W - 1], **document_inputs(t[:, 2 * W:3 * W - 1])).logits.detach()
    weight = learned_weight(t, W)
    targets = t[:, 1:W].clone()
    out = []
    for tg in (targets, torch.where(weight > 0, targets, (targets + 7) % VOCAB)):
        x = logits.clone().requires_grad_(True)
        loss = (cross_entropy(x, tg) * weight).sum() / weight.sum()
        loss.backward()
        out.append((loss.item(), x.grad))
    assert (weight == 0).sum() > 10
    assert abs(out[0][0] - out[1][0]) < 1e-7 and torch.equal(out[0][1], out[1][1])


def test_an_all_ones_mask_gives_todays_loss(model):
    rng = np.random.default_rng(1)
    tok = rng.integers(0, VOCAB, (8, W))
    rows = np.concatenate([tok, np.ones((8, W), np.int64), np.ones((8, W), np.int64)], axis=1)
    loss, _ = _step(model, rows, world=2, acc=2)
    t = torch.from_numpy(tok)
    today = np.mean([float(token_losses(model, t[i:i + 2], window=W, document_mask=False)[0].mean().detach())
                     for i in range(0, 8, 2)])  # the text path: mean per micro-batch, averaged
    assert abs(loss - today) < 1e-6


def test_an_example_gives_the_same_logits_whatever_precedes_it(model):
    rng = np.random.default_rng(2)
    a = rng.integers(1, VOCAB, 6)
    outs = []
    for prev_len in (0, 3, 9):
        prev = rng.integers(1, VOCAB, prev_len)
        tok = np.concatenate([prev, a, np.zeros(W - 1 - prev_len - len(a), np.int64)])
        seg = np.concatenate([np.full(prev_len, 1), np.full(len(a), 2), np.zeros(W - 1 - prev_len - len(a), np.int64)])
        t, s = torch.from_numpy(tok)[None], torch.from_numpy(seg)[None]
        with torch.no_grad():
            logits = model(input_ids=t, **document_inputs(s)).logits[0, prev_len:prev_len + len(a)]
        outs.append(logits)
    assert max(float((o - outs[0]).abs().max()) for o in outs[1:]) < 1e-5
    pos = document_inputs(torch.tensor([[1, 1, 1, 2, 2, 0, 0]]))["position_ids"].tolist()
    assert pos == [[0, 1, 2, 0, 1, 0, 1]]
