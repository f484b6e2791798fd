"""Bench (issue 28): one worker's peak host RSS for a full fine-tuning step vs a LoRA step, same model, ZeRO-2, fp32.

Each variant runs in a fresh process (one-rank gloo group): raytrain.model.build_model, raytrain.lora.prepare_model
(LoRA only), deepspeed.initialize with the loop's parameter groups, one step of the fine-tuning loss. Peak RSS is
counted from after the imports (VmHWM reset). Usage: python scripts/benchkit/lora_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# ~105M parameters: states dominate (full: fp32 weights + grads + master + 2 Adam moments).
OVERRIDES = ["model.family=llama", "model.n_layer=8", "model.hidden_size=768", "model.n_head=12",
             "model.intermediate_size=2048", "model.vocab_size=32000", "model.seq_len=64",
             "model.tie_embeddings=false", "precision.dtype=fp32", "deepspeed.zero_stage=2",
             "batch.micro_batch_size=1"]

WORKER = r"""
import gc, json, sys
import psutil, torch
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()  # as a training worker imports it: no shm op built
import deepspeed
import torch.distributed as dist
from raytrain import lora
from raytrain.config import load_config
from raytrain.ds_config import build_ds_config
from raytrain.model import build_model, param_count, param_groups
torch.set_num_threads(1)
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = psutil.Process().memory_info().rss
cfg = load_config("tiny", json.loads(sys.argv[1]))
ds = build_ds_config(cfg, 1, "fp32", cuda=False)
model = build_model(cfg.model, cfg.model.vocab_size, 0, ds_config=ds)
n = param_count(model)
model, _ = lora.prepare_model(model, cfg.model, seed=0)
engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1), config=ds,
                                  dist_init_required=False)
x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1))
logits = engine(input_ids=x[:, :-1]).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
engine.backward(loss); engine.step()
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print("RESULT " + json.dumps({"peak_above_imports": peak - base, "params": n,
                              "trainable": lora.trainable_count(engine.module)}), flush=True)
"""


def run(extra: list[str]) -> dict:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + len(extra)), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(OVERRIDES + extra)], env=env,
                         capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(line[7:])


if __name__ == "__main__":
    full = run([])
    lo = run(["model.lora.r=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    load = open("/proc/loadavg").read().split()[:3]
    print(json.dumps({"full": full, "lora": lo, "ratio": lo["peak_above_imports"] / full["peak_above_imports"],
                      "loadavg": load}, indent=1))
