"""Cross entropy fused with the output projection, chunk by chunk: the loss of hidden states without the whole
micro-batch's [tokens, vocab] logits ever existing.

Why: at GPT-2's vocabulary (50,257) a micro-batch of 16 x 1024 tokens has 0.8 G logits, 3.3 GB in fp32 plus
their gradient: more memory than the model's activations and a large share of the step's memory traffic. Here
each chunk's logits are made, turned into its loss and its gradient at once (the gradient is known in the
forward: softmax minus the one-hot target, times each token's weight), and dropped; backward only scales the
stored gradients by the upstream scalar. The same scheme as liger-kernel's fused linear cross entropy (Hsu et
al. 2024), in plain torch so that it runs on CPU, on any GPU, and under ZeRO-1/2 as it is.
Chunk size as liger chooses it: a chunk's logits are about as large as the hidden states ([tokens, hidden]).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def chunk_tokens(n_tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: about n_tokens x hidden / vocab, a power of two, at least 1."""
    per = math.ceil(n_tokens / max(1, math.ceil(vocab / hidden)))
    return max(1, 1 << max(0, per - 1).bit_length())


def chunked_head_bytes(n_tokens: int, hidden: int, vocab: int) -> int:
    """What the chunked loss holds beyond the hidden states: one chunk's fp32 logits and their gradient, and the
    output projection's fp32 gradient (whatever the number of tokens)."""
    return chunk_tokens(n_tokens, hidden, vocab) * vocab * 4 * 2 + vocab * hidden * 4


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i weight_i * CE(hidden_i @ W.T + b, target_i), gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_weight, chunk, grad):
        # (grad mode is off inside forward: whether gradients are wanted comes from the caller)
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        g_hidden = torch.empty_like(hidden) if grad and hidden.requires_grad else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grad and weight.requires_grad else None
        g_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if grad and bias is not None and bias.requires_grad else None
        for s in range(0, n, chunk):
            h, t, w = hidden[s:s + chunk], targets[s:s + chunk], token_weight[s:s + chunk].float()
            logits = (h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())).float()
            lse = torch.logsumexp(logits, dim=-1)
            ce = lse - logits.gather(1, t[:, None]).squeeze(1)
            total += (ce * w).sum()
            if g_hidden is None and g_weight is None and g_bias is None:
                continue
            # d(w * ce)/d logits = w * (softmax - onehot), made in place in the chunk's logits
            g = logits.sub_(lse[:, None]).exp_()
            g[torch.arange(len(t), device=g.device), t] -= 1.0
            g.mul_(w[:, None])
            g_low = g.to(hidden.dtype)
            if g_hidden is not None:
                g_hidden[s:s + chunk] = g_low @ weight
            if g_weight is not None:
                # In the activations' precision on the matrix units (fp32 accumulation inside), summed in fp32:
                # an fp32 product here would be the head's largest multiply off the bf16 units.
                g_weight.add_(g_low.t() @ h)
            if g_bias is not None:
                g_bias += g.sum(0)
        ctx.save_for_backward(g_hidden, g_weight, g_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        g_hidden, g_weight, g_bias = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_out.float()
        return (g_hidden * scale.to(g_hidden.dtype) if g_hidden is not None else None,
                (g_weight * scale).to(w_dtype) if g_weight is not None else None,
                (g_bias * scale).to(b_dtype) if g_bias is not None else None,
                None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         token_weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         chunk: Optional[int] = None) -> torch.Tensor:
    """Scalar fp32 sum over tokens of token_weight x cross entropy of (hidden @ weight.T + bias) against targets.
    hidden [..., h], targets and token_weight [...] (the leading shapes flattened together); weight [vocab, h]."""
    h = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk or chunk_tokens(h.shape[0], h.shape[1], weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, bias, targets.reshape(-1), token_weight.reshape(-1), chunk, grad)


class HiddenOutHead(torch.nn.Linear):
    """The output projection of a model trained with the chunked loss: inside `hidden_out(head)` its forward
    returns its input (the final hidden states), which the loss projects chunk by chunk; outside, a plain
    Linear. The same parameters and state-dict names: checkpoints and exports do not see the difference."""

    raytrain_hidden_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.raytrain_hidden_out else super().forward(x)


def use_chunked_loss(model: torch.nn.Module) -> None:
    """From now on the losses of raytrain.worker.loss take the chunked path on this model (its output
    projection becomes a HiddenOutHead in place)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise RuntimeError(f"model.loss=chunked: the output projection of {type(model).__name__} is a "
                           f"{type(head).__name__}, not a Linear; set model.loss=full")
    head.__class__ = HiddenOutHead


def chunked_head(model) -> Optional[HiddenOutHead]:
    """The model's output projection if it takes the chunked loss (a DeepSpeed engine or the model itself)."""
    module = getattr(model, "module", model)
    get = getattr(module, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if isinstance(head, HiddenOutHead) else None


class hidden_out:
    """Within: the head's forward returns the hidden states."""

    def __init__(self, head: HiddenOutHead):
        self.head = head

    def __enter__(self):
        self.head.raytrain_hidden_out = True

    def __exit__(self, *exc):
        self.head.raytrain_hidden_out = False
