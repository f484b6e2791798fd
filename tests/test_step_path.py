"""The step path's kernels (worker/engine.py, worker/linear_ce.py): compiled blocks, the chunked loss and the
fused AdamW train to commit 3653663's losses; the chunked loss never makes the [tokens, vocab] fp32 logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from raytrain.config import load_config
from raytrain.model import build_model, compiles
from raytrain.worker.linear_ce import chunked_head, linear_cross_entropy, use_chunked_loss
from raytrain.worker.loss import StepLoss

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = json.loads((ROOT / "tests/data/numerics_3653663.json").read_text())

_RUN = """
import json, sys
sys.path.insert(0, {scripts!r})
import torch._dynamo.utils
from raytrain.config import load_config
from benchkit.step_path import counting_rows, run
ref = json.load(open({ref!r}))
cfg = load_config("tiny", ref["overrides"] + {extra!r})
out = run(cfg, counting_rows(ref["rows"], cfg.model.seq_len + 1, ref["vocab"]), vocab=ref["vocab"], cuda=False, steps=20)
out["unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print("RESULT " + json.dumps(out))
"""


def _run(*extra: str) -> dict:
    code = _RUN.format(scripts=str(ROOT / "scripts"), ref=str(ROOT / "tests/data/numerics_3653663.json"),
                       extra=list(extra))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_compiled_chunked_fused_step_path_matches_3653663():
    """20 steps of 2 micro-batches: compiled blocks + chunked loss + fused AdamW give 3653663's losses (rtol 1e-4);
    dynamo compiled graphs, the optimizer ran fused, and the loss fell."""
    out = _run("model.compile=true", "model.loss=chunked", "optim.fused=torch")
    assert out["kernels"] == {"compiled": "2 blocks", "loss": "chunked", "optimizer": "AdamW (fused)"}, out["kernels"]
    assert out["unique_graphs"] >= 1, "torch.compile compiled nothing"
    assert out["losses"] == pytest.approx(REFERENCE["losses"], rel=1e-4)
    assert out["losses"][-1] < out["losses"][0] - 0.5


def _tiny_model(vocab: int = 300):
    cfg = load_config("tiny", ["data.train=/nowhere", "model.n_layer=1", "model.hidden_size=32", "model.n_head=2",
                               "model.seq_len=32"])
    return build_model(cfg.model, vocab, seed=0)


class _Float32Sizes(TorchDispatchMode):
    """Records the element count of every fp32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_loss_never_makes_the_whole_fp32_logits(chunked):
    """Forward and backward of a micro-batch's loss: the full path makes [b, seq, vocab] fp32 tensors (the
    detector works), the chunked one none as large; both give the same loss and gradients."""
    b, seq, vocab = 4, 32, 300
    model = _tiny_model(vocab)
    if chunked:
        use_chunked_loss(model)
    data_cfg = load_config("tiny", ["data.train=/nowhere"]).data
    loss_fn = StepLoss(data_cfg, window=seq + 1, accumulation=1, world=1, dp_size=1, device=torch.device("cpu"))
    x = torch.from_numpy(__import__("numpy").random.default_rng(0).integers(0, vocab, (b, seq + 1)))
    loss_fn.begin(x.numpy())
    with _Float32Sizes() as seen:
        loss = loss_fn(model, x)
        loss.backward()
    whole = b * seq * vocab
    assert (max(seen.sizes) >= whole) is (not chunked), (max(seen.sizes), whole)
    reference = _tiny_model(vocab)
    logits = reference(input_ids=x[:, :-1]).logits
    ref_loss = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_chunked_head_keeps_names_and_plain_forward():
    """The head swap changes neither the state dict nor what the model returns outside the loss."""
    model, plain = _tiny_model(), _tiny_model()
    use_chunked_loss(model)
    assert chunked_head(model) is not None and chunked_head(plain) is None
    assert list(model.state_dict()) == list(plain.state_dict())
    x = torch.arange(10)[None]
    assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)


def test_linear_cross_entropy_matches_logits_in_bf16_and_with_bias():
    torch.manual_seed(0)
    n, h, v = 70, 16, 300
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
        weight = (torch.randn(v, h) * 0.1).to(dtype).requires_grad_()
        bias = (torch.randn(v) * 0.1).to(dtype).requires_grad_()
        t, w = torch.randint(0, v, (n,)), torch.rand(n)
        got = linear_cross_entropy(hidden, weight, t, w, bias=bias, chunk=16)
        grads = torch.autograd.grad(got * 3.0, (hidden, weight, bias))
        want = (F.cross_entropy(F.linear(hidden, weight, bias).float(), t, reduction="none") * w).sum()
        wants = torch.autograd.grad(want * 3.0, (hidden, weight, bias))
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for g, ref in zip(grads, wants):
            assert g.dtype == ref.dtype and torch.allclose(g.float(), ref.float(), rtol=tol, atol=tol)


def test_kernel_defaults_resolve_by_device_and_setting():
    base = ["data.train=/nowhere"]
    cfg = load_config("tiny", base)
    assert (compiles(cfg.model, cuda=False), compiles(cfg.model, cuda=True)) == (False, True)
    assert cfg.chunked_loss and not load_config("tiny", base + ["deepspeed.zero_stage=3"]).chunked_loss
    lora = load_config("tiny", base + ["model.lora.r=4"])
    assert not compiles(lora.model, cuda=True) and not lora.chunked_loss
    assert not load_config("tiny", base + ["model.loss=full"]).chunked_loss


@pytest.mark.slow
def test_no_host_synchronisation_on_steady_steps(ray_cluster, tiny_data, tmp_path):
    """Counted by the host-reads probe on 2 workers: raytrain's own code reads no tensor value made in the step on
    steps that neither log nor checkpoint; log and checkpoint steps read theirs (the probe sees reads)."""
    from raytrain.trainer import train
    from tests.helpers import tiny_cfg

    probe = tmp_path / "reads.jsonl"
    cfg = tiny_cfg(tiny_data, tmp_path, "syncs", "run.log_every=4", "run.max_steps=16", "checkpoint.every_n_steps=8",
                   "checkpoint.memory_every_n_steps=auto", "health.grace_steps=0")
    train(cfg, log=lambda *_: None, inject={"count_host_reads": str(probe)})
    steps = [json.loads(line) for line in probe.read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 17))
    quiet = {s["step"]: s["reads"] for s in steps if s["acts"] is False}
    acting = {s["step"]: s["reads"] for s in steps if s["acts"]}
    assert sorted(acting) == [4, 8, 12, 16] and sorted(quiet) == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    assert all(reads == [] for reads in quiet.values()), quiet
    assert all(any("verdict.py" in r for r in reads) for reads in acting.values()), acting
    # The first log window (steps 2-4) starts after the attempt's first step, a warm-up step that is not logged: its
    # step time covers exactly its 3 steps, so the goodput ledger places every second (its first_step phase ends
    # once the records start-up deferred past the first step are open).
    from raytrain.rundir import ATTEMPTS, GOODPUT, METRICS, RunDir

    run = RunDir(cfg.run_uri)
    (attempt,) = run.read_jsonl(ATTEMPTS)
    step4 = next(r for r in run.read_jsonl(METRICS) if r.get("step") == 4 and "loss" in r)
    assert step4["step_time_s"] * 3 == pytest.approx(step4["time"] - attempt["records_opened_time"], abs=0.03)
    assert attempt["first_step_time"] <= attempt["records_opened_time"]
    g = run.read_json(GOODPUT)
    assert g["seconds"]["other"] <= 0.01 * g["wall_s"], g["seconds"]


def _auto_cfg(*extra: str):
    from tests.helpers import tiny_cfg

    return tiny_cfg("/nowhere", "/tmp", "auto", "batch.micro_batch_size=auto", "batch.global_batch_size=16", *extra)


def test_auto_micro_batch_is_the_largest_that_fits_the_cap_and_keeps_the_global_batch():
    from raytrain.errors import UserError
    from raytrain.micro_batch import resolve
    from raytrain.sweep.memory_estimate import estimate_mb

    cfg = _auto_cfg()
    assert cfg.global_batch == 16 and cfg.scaling.num_workers == 2  # 8 sequences per worker per step

    def need(mb: int) -> float:
        return estimate_mb(_auto_cfg(f"batch.micro_batch_size={mb}", "batch.global_batch_size=null",
                                     "batch.gradient_accumulation_steps=1"), 300)["total_mb"]

    assert need(1) < need(2) < need(4) < need(8)
    for cap, mb in ((need(8) + 1, 8), ((need(4) + need(8)) / 2, 4), (need(2), 2), (need(1), 1)):
        out = resolve(cfg, vocab=300, memory_mb=cap, log=lambda *_: None)
        assert (out.batch.micro_batch_size, out.accumulation, out.global_batch) == (mb, 8 // mb, 16)
    with pytest.raises(UserError, match="even a micro-batch of 1 needs about .* raise batch.memory_cap_mb"):
        resolve(cfg, vocab=300, memory_mb=need(1) * 0.99)


def test_auto_micro_batch_needs_a_global_batch():
    from raytrain.config import load_config
    from raytrain.errors import UserError

    with pytest.raises(UserError, match="batch.micro_batch_size=auto needs batch.global_batch_size"):
        load_config("tiny", ["data.train=/nowhere", "batch.micro_batch_size=auto"])
    with pytest.raises(UserError, match="must be a whole number of sequences >= 1 or 'auto'"):
        load_config("tiny", ["data.train=/nowhere", "batch.micro_batch_size=big"])


@pytest.mark.slow
def test_a_run_with_auto_micro_batch_trains_with_the_chosen_size(ray_cluster, tiny_data, tmp_path):
    """On CPU with a memory cap that fits 2 sequences but not 4: the run trains micro-batches of 2, accumulation 4,
    global batch 16, and its config.yaml and checkpoint say so."""
    from raytrain.config import load_config
    from raytrain.sweep.memory_estimate import estimate_mb
    from raytrain.trainer import train
    from tests.helpers import tiny_cfg

    fixed = tiny_cfg(tiny_data, tmp_path, "mb", "batch.micro_batch_size=3", "batch.gradient_accumulation_steps=1")
    vocab = json.loads((tiny_data / "train" / "manifest.json").read_text())["vocab_size"]
    sizes = [estimate_mb(fixed.model_copy(update={"batch": fixed.batch.model_copy(update={"micro_batch_size": m})}),
                         vocab)["total_mb"] for m in (2, 4)]
    cfg = tiny_cfg(tiny_data, tmp_path, "mbauto", "batch.micro_batch_size=auto", "batch.global_batch_size=16",
                   f"batch.memory_cap_mb={sum(sizes) / 2}", "run.max_steps=3", "checkpoint.every_n_steps=3")
    lines = []
    train(cfg, log=lines.append)
    assert any("batch.micro_batch_size=auto: 2 (" in line for line in lines), lines
    saved = load_config(str(tmp_path / "mbauto" / "config.yaml"), [])
    assert (saved.batch.micro_batch_size, saved.accumulation, saved.global_batch) == (2, 4, 16)
    state = json.loads((tmp_path / "mbauto" / "checkpoint_00000003" / "raytrain_state.json").read_text())
    assert state["samples_seen"] == 3 * 16
