"""DeepSpeed's Muon modules set aside where the optimizer is not Muon (raytrain.deepspeed_internals): engines of every
ZeRO stage train as before, and torch's compiler stack (1.4 s of every worker's start-up) is never loaded."""

import json
import os
import subprocess
import sys

from raytrain.deepspeed_internals import MUON_STAND_INS, set_muon_aside

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process, as a training worker: a 1-rank gloo group, the real model and DeepSpeed config, 4 steps on one
# batch for ZeRO-1, 2 and 3 (ZeRO-3 also in bf16: its own optimizer class), then which modules were loaded.
PROBE = r"""
import json, sys
import torch
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()
import deepspeed
from raytrain.config import load_config
from raytrain.deepspeed_internals import set_muon_aside
from raytrain.ds_config import build_ds_config
from raytrain.model import build_model
from raytrain.worker.evaluate import lm_loss
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
out = {"set_aside": [], "losses": {}}
for stage, dtype in ((1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")):
    cfg = load_config("tiny", [f"deepspeed.zero_stage={stage}", "model.n_layer=1", "model.hidden_size=32",
                               "model.n_head=2", "model.seq_len=16", "batch.micro_batch_size=2"])
    ds_config = build_ds_config(cfg, 1, dtype, cuda=False)
    out["set_aside"].append(set_muon_aside(ds_config))
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg.model, 256, 0, ds_config=ds_config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    losses = []
    for _ in range(4):
        loss = lm_loss(engine, x); engine.backward(loss); engine.step(); losses.append(loss.item())
    out["losses"][f"{stage}-{dtype}"] = losses
out["compiler_loaded"] = [m for m in ("torch._inductor.compile_fx", "torch._inductor.lowering") if m in sys.modules]
print("RESULT " + json.dumps(out))
"""


def test_engines_of_every_zero_stage_train_without_loading_the_compiler_stack():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29000 + os.getpid() % 1000))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # Set aside once (the first engine); the stand-ins stay for the process's later engines.
    assert out["set_aside"] == [True, False, False, False], out
    for case, losses in out["losses"].items():
        assert losses[-1] < losses[0], (case, losses)  # the optimizer steps: the batch's loss falls
    assert out["compiler_loaded"] == [], out


def test_a_run_configured_with_muon_gets_the_real_modules():
    before = {m: sys.modules.get(m) for m in MUON_STAND_INS}
    assert set_muon_aside({"optimizer": {"type": "Muon", "params": {}}}) is False
    assert {m: sys.modules.get(m) for m in MUON_STAND_INS} == before  # nothing put in their place
