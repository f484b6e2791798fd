#!/usr/bin/env python3
"""The prepared GPU check (issue 44): raytrain's step path on one GPU, without Ray, beside the frozen baselines.

Run through scripts/gpu_check.sh on the GPU machine (it installs the carried wheels and bounds the whole run);
docs/BENCHMARKS.md, "GPU check (issue 44)", says how and what the targets are. The parts, in priority order, each
in a child process of its own with its own time cap (a part that hangs or crashes costs only its cap), and
OUT/gpu_check.json rewritten after every part (OUT/gpu_check.log holds every child's output):

1. gpt2_124m: GPT-2 124M (seq 1024, micro-batch 16, bf16, ZeRO-1): (a) raytrain's step path
   (scripts/benchkit/step_path.py: compiled blocks, chunked loss, fused AdamW), (b) the frozen plain PyTorch +
   DeepSpeed loop (scripts/benchkit/baselines.py, commit 3653663), (c) a plain torch.compile loop (below): tokens/s,
   MFU, ratios (a)/(b) and (a)/(c).
2. snapshots_124m: the same step path with memory snapshots at the default cadence (checkpoint.memory_every_n_steps
   auto: measured over the first 8 steps, then the interval that keeps them under memory_cost_target) against none,
   in alternating windows of one run. MemoryTier's own capture and copy; the two generation files are made here as
   the node actor would make them (that actor is Ray's; see LocalMemoryTier).
3. test_gpu: tests/test_gpu.py with pytest where Ray is importable; skipped otherwise (Ray's wheel is over what a
   device call carries).
4. llama_1b: a ~1.1B Llama (22 x 2048, GQA 32/4, seq 2048, vocab 32000): the step path, the plain torch.compile
   loop, then the frozen DeepSpeed loop if time is left.

`--plan` prints the parts and caps as JSON; `--cpu-smoke` runs every part at toy sizes on the CPU (no GPU
baseline) to catch mistakes here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # benchkit
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # raytrain, tests (where PYTHONPATH does not name the tree)

TOTAL_S = 280  # the whole run, under gpu_check.sh's `timeout 290`: 5 minutes with the wheels' install before it
PEAK_FLOPS = 989e12  # dense bf16 of an H100 SXM, the MFU denominator on the H200 too (the issue's convention)
ASSUMED_MFU = 0.40  # for step counts: the timed steps are sized from FLOPs at this rate


@dataclass(frozen=True)
class Part:
    name: str
    cap_s: int  # the most this part may take; it also gets whatever earlier parts left of theirs
    what: str


PARTS = (
    Part("gpt2_124m", 115, "GPT-2 124M: step path vs frozen plain PyTorch + DeepSpeed vs plain torch.compile"),
    Part("snapshots_124m", 45, "GPT-2 124M step path: memory snapshots at the default cadence vs none"),
    Part("test_gpu", 15, "tests/test_gpu.py (needs Ray)"),
    Part("llama_1b", 105, "~1.1B Llama: step path vs plain torch.compile (and frozen DeepSpeed if time is left)"),
)

TARGETS = {  # (part, field, threshold, what)
    "gpt2_124m step path MFU >= 40%": ("gpt2_124m", ("step_path", "mfu"), 0.40),
    "gpt2_124m step path >= 1.6x frozen PyTorch + DeepSpeed": ("gpt2_124m", ("ratios", "step_path/frozen_deepspeed"), 1.6),
    "llama_1b step path MFU >= 40%": ("llama_1b", ("step_path", "mfu"), 0.40),
    "snapshots at the default cadence >= 0.98x none": ("snapshots_124m", ("ratio_on_off",), 0.98),
}

BASE = ["data.train=/nowhere", "data.val=null", "scaling.num_workers=1", "batch.gradient_accumulation_steps=1",
        "optim.warmup_steps=10", "run.max_steps=10000", "checkpoint.every_n_steps=1000",
        "model.attn_implementation=sdpa"]
GPU = ["scaling.use_gpu=true", "precision.dtype=bf16", "deepspeed.zero_stage=1"]
SHAPES = {  # (overrides, vocab) on the GPU, and at toy size for --cpu-smoke
    "gpt2": (["model.family=gpt2", "model.n_layer=12", "model.hidden_size=768", "model.n_head=12",
              "model.seq_len=1024", "model.vocab_size=50257", "batch.micro_batch_size=16", "optim.lr=6e-4"], 50257),
    "llama": (["model.family=llama", "model.n_layer=22", "model.hidden_size=2048", "model.n_head=32",
               "model.n_kv_head=4", "model.intermediate_size=5632", "model.seq_len=2048", "model.vocab_size=32000",
               "model.tie_embeddings=false", "model.activation_checkpointing=false", "batch.micro_batch_size=8",
               "optim.lr=3e-4"], 32000),
    "gpt2-smoke": (["model.family=gpt2", "model.n_layer=2", "model.hidden_size=64", "model.n_head=4",
                    "model.seq_len=64", "model.vocab_size=512", "batch.micro_batch_size=4"], 512),
    "llama-smoke": (["model.family=llama", "model.n_layer=2", "model.hidden_size=64", "model.n_head=4",
                     "model.n_kv_head=2", "model.intermediate_size=128", "model.seq_len=64", "model.vocab_size=512",
                     "model.tie_embeddings=false", "batch.micro_batch_size=4"], 512),
}


# ----------------------------------------------------------------------------------------------------- the parent

def plan() -> dict:
    return {"total_s": TOTAL_S, "parts": [{"name": p.name, "cap_s": p.cap_s, "what": p.what} for p in PARTS],
            "caps_sum_s": sum(p.cap_s for p in PARTS)}


def _sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict:
    from importlib import metadata

    env: dict = {"python": platform.python_version(), "host_cpus": os.cpu_count()}
    for name in ("torch", "deepspeed", "transformers", "pydantic", "ray", "triton"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    try:
        import torch

        env["torch"], env["torch_cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    smi = _sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    if smi:
        name, driver, mem = [s.strip() for s in smi.splitlines()[0].split(",")]
        env.update({"device": name, "driver": driver, "device_memory": mem, "gpus": len(smi.splitlines())})
    env["commit"] = _sh("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD") or None
    return env


def _targets(parts: dict) -> dict:
    out = {}
    for label, (part, path, threshold) in TARGETS.items():
        v = parts.get(part, {})
        for key in path:
            v = v.get(key) if isinstance(v, dict) else None
        out[label] = {"value": v, "met": (v >= threshold) if isinstance(v, (int, float)) else None}
    return out


class Report:
    def __init__(self, out: Path, smoke: bool):
        self.path, self.log_path = out / "gpu_check.json", out / "gpu_check.log"
        self.t0 = time.time()
        self.data = {"check": "raytrain GPU check (issue 44), scripts/gpu_check.py",
                     "mode": "cpu-smoke" if smoke else "gpu",
                     "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "plan": plan(), "env": environment(), "parts": {}, "targets": {}}

    def part(self, name: str, rec: dict) -> None:
        self.data["parts"][name] = rec
        self.write()

    def write(self) -> None:
        self.data["wall_s"] = round(time.time() - self.t0, 1)
        self.data["targets"] = _targets(self.data["parts"])
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(f"[gpu_check {time.time() - self.t0:6.1f}s] {line}\n")


class _Stop(Exception):
    pass


def _on_term(signum, frame):
    raise _Stop(f"signal {signum}")


def run_parent(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out, args.cpu_smoke)
    selected = [p for p in PARTS if not args.parts or p.name in args.parts.split(",")]
    rep.say(f"gpu_check: {rep.data['env'].get('device', 'no GPU seen by nvidia-smi')}, torch {rep.data['env']['torch']}, "
            f"deepspeed {rep.data['env']['deepspeed']}; parts {', '.join(p.name for p in selected)}; results in {out}/")
    rep.write()
    deadline = rep.t0 + args.total_s
    signal.signal(signal.SIGTERM, _on_term)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    ok = True
    try:
        for i, part in enumerate(selected):
            # Its own cap, plus whatever the parts before it left of theirs; the later parts keep their caps.
            budget = deadline - time.time() - sum(p.cap_s for p in selected[i + 1:])
            if budget < 5:
                rep.part(part.name, {"status": "skipped", "skipped": f"no time left ({budget:.0f} s)"})
                ok = False
                continue
            rep.say(f"part {i + 1}/{len(selected)} {part.name} (up to {budget:.0f} s): {part.what}")
            t = time.time()
            rec = run_part(part, budget, args, work, rep)
            rec["wall_s"] = round(time.time() - t, 1)
            rep.part(part.name, rec)
            ok &= rec.get("status") in ("ok", "skipped")
            rep.say(f"part {part.name}: {rec.get('status')} in {rec['wall_s']} s: {summary(part.name, rec)}")
    except (_Stop, KeyboardInterrupt) as e:
        rep.say(f"gpu_check: stopped ({e}); results so far are in {rep.path}")
        rep.write()
        return 124
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    rep.write()
    for label, t in rep.data["targets"].items():
        v = t["value"]
        rep.say(f"target {label}: {'-' if v is None else f'{v:.3f}'} "
                f"{'met' if t['met'] else 'NOT met' if t['met'] is False else '(not measured)'}")
    rep.say(f"gpu_check: done in {time.time() - rep.t0:.0f} s; {rep.path}")
    return 0 if ok else 1


def run_part(part: Part, budget: float, args, work: Path, rep: Report) -> dict:
    """The part in a child process (its own session, killed whole at the budget); its result file holds whatever
    it finished, also when it was killed."""
    if part.name == "test_gpu":
        return test_gpu(budget, args, rep)
    result = work / f"{part.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part.name, "--result", str(result),
           "--deadline", str(time.time() + budget - 3)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    with open(rep.log_path, "a") as log:
        log.write(f"----- {part.name}: {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        stopped = None
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
            with contextlib.suppress(ProcessLookupError):  # what it left in its session (compile workers)
                os.killpg(proc.pid, signal.SIGKILL)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, status = None, f"timeout after {budget:.0f} s (killed)"
        except (_Stop, KeyboardInterrupt) as e:
            _kill(proc)
            rc, status, stopped = None, f"stopped ({e or type(e).__name__})", e
    _remove_leftovers(since=time.time() - budget - 60)
    rec = json.loads(result.read_text()) if result.exists() else {}
    raised = "error" in rec or any("error" in v for v in rec.values() if isinstance(v, dict))
    if rc != 0 or raised:
        with open(rep.log_path) as f:
            f.seek(start)
            rec["log_tail"] = f.read()[-4000:].splitlines()[-30:]
    if rc == 0 and raised:
        status = "failed (a measurement raised)"
    if rec.get("skipped") and rc == 0:
        status = "skipped"
    rec["status"] = status
    if stopped is not None:
        rep.part(part.name, rec)  # what it finished, before the run stops
        raise stopped
    return rec


def _remove_leftovers(since: float) -> None:
    """Snapshot files of a killed snapshots part (its own clean-up did not run): gigabytes of shared memory."""
    import glob
    import shutil

    for d in glob.glob("/dev/shm/gpu_check-*"):
        try:
            if os.stat(d).st_mtime >= since:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _kill(proc: subprocess.Popen) -> None:
    """The child's whole session (it leads its own process group): SIGTERM, then SIGKILL after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            t = time.time()
            while time.time() - t < 5:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    proc.poll()
                    return
                proc.poll()  # reaps the leader once it exits
                time.sleep(0.1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def test_gpu(budget: float, args, rep: Report) -> dict:
    import importlib.util

    if args.cpu_smoke:
        return {"status": "skipped", "skipped": "--cpu-smoke: tests/test_gpu.py needs CUDA (and starts Ray)"}
    if importlib.util.find_spec("ray") is None:
        return {"status": "skipped", "skipped": "Ray is not importable here: its cp312 wheel (79 MB) is over the "
                                                "64 MiB a device call carries, and the tests run through Ray Train"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    with open(rep.log_path, "a") as log:
        log.write(f"----- test_gpu: {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
    with open(rep.log_path) as f:
        f.seek(start)
        lines = f.read().splitlines()
    summary_line = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), None)
    return {"status": "ok" if rc == 0 else "timeout" if rc is None else f"failed (exit {rc})",
            "pytest": summary_line, "log_tail": lines[-20:] if rc != 0 else None}


def summary(name: str, rec: dict) -> str:
    if rec.get("skipped"):
        return str(rec["skipped"])
    bits = []
    for key in ("step_path", "frozen_deepspeed", "plain_compile"):
        m = rec.get(key)
        if isinstance(m, dict) and m.get("tokens_per_s"):
            mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else ""
            bits.append(f"{key} {m['tokens_per_s']:,.0f} tokens/s{mfu}")
        elif isinstance(m, dict) and (m.get("error") or m.get("skipped")):
            bits.append(f"{key}: {m.get('error') or m.get('skipped')}")
    for k, v in (rec.get("ratios") or {}).items():
        if v is not None:
            bits.append(f"{k} {v:.3f}")
    if "ratio_on_off" in rec:
        bits.append(f"on/off {rec['ratio_on_off']:.3f} (every {rec.get('every')} steps)")
    if rec.get("error"):
        bits.append(str(rec["error"]))
    return "; ".join(bits) or "-"


# ------------------------------------------------------------------------------------------------------ the child

class Child:
    """One part's measurements, each caught on its own and saved as soon as it finishes."""

    def __init__(self, args):
        self.result, self.smoke, self.deadline = Path(args.result), args.cpu_smoke, args.deadline
        self.cuda = not self.smoke
        self.rec: dict = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        tmp = self.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec, default=str))
        tmp.replace(self.result)

    def measure(self, key: str, fn, *, needs_s: float = 0.0):
        """rec[key] = fn() (a dict), or the error's tail; skipped when less than needs_s of the part is left."""
        if self.left() < needs_s:
            self.rec[key] = {"skipped": f"{self.left():.0f} s of the part left, {needs_s:.0f} s needed"}
            self.save()
            return None
        import torch

        t = time.time()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        print(f"[{key}] start ({self.left():.0f} s of the part left)", flush=True)
        try:
            self.rec[key] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the part's later measurements still run
            tb = traceback.format_exc().splitlines()
            self.rec[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                             "traceback_tail": tb[-12:]}
            traceback.print_exc()
        self.rec[key]["wall_s"] = round(time.time() - t, 1)
        if self.cuda:
            self.rec[key]["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        self.save()
        print(f"[{key}] {json.dumps(self.rec[key], default=str)[:600]}", flush=True)
        _free()
        return self.rec[key]


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def config(shape: str, smoke: bool, *extra: str):
    from raytrain.config import load_config

    overrides, vocab = SHAPES[shape + ("-smoke" if smoke else "")]
    return load_config("tiny", BASE + ([] if smoke else GPU) + overrides + list(extra)), vocab


def model_flops(cfg, vocab: int) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the model the config builds, counted on the meta device."""
    import torch

    from raytrain.model import build_model, flops_per_token, param_counts

    with torch.device("meta"):
        model = build_model(cfg.model, vocab, cfg.run.seed)
    total, active = param_counts(model, cfg.model)
    return total, flops_per_token(active, cfg.model)


def sized_steps(fpt: float, tokens_per_step: int, mfu: float, seconds: float, lo: int, hi: int) -> int:
    """Timed steps that take about `seconds` at `mfu` of the peak."""
    step_s = fpt * tokens_per_step / (mfu * PEAK_FLOPS)
    return max(lo, min(hi, math.ceil(seconds / step_s)))


def with_mfu(m: dict, fpt: float, cuda: bool) -> dict:
    tps = m.get("tokens_per_s")
    m["mfu"] = fpt * tps / PEAK_FLOPS if (cuda and tps) else None
    return m


def step_path_measure(cfg, vocab: int, steps: int, warmup: int, cuda: bool, fpt: float) -> dict:
    """(a) raytrain's step path, scripts/benchkit/step_path.py, as the training worker builds it."""
    from benchkit.step_path import counting_rows, run

    per_step = cfg.batch.micro_batch_size * cfg.accumulation
    rows = counting_rows(per_step * min(steps, 8), cfg.model.seq_len + 1, vocab)
    t = time.time()
    out = run(cfg, rows, vocab=vocab, cuda=cuda, steps=steps, warmup=warmup, sync_every_step=False)
    return with_mfu({"tokens_per_s": out["tokens_per_s"], "step_s": out["step_s"], "kernels": out["kernels"],
                     "steps": steps, "warmup": warmup, "micro_batch": cfg.batch.micro_batch_size,
                     "build_compile_and_run_s": round(time.time() - t, 1),
                     "loss_first": out["losses"][0], "loss_last": out["losses"][-1]}, fpt, cuda)


def frozen_deepspeed_measure(cfg, vocab: int, steps: int, warmup: int, fpt: float) -> dict:
    """(b) the frozen plain PyTorch + DeepSpeed loop of commit 3653663 (scripts/benchkit/baselines.py)."""
    from benchkit.baselines import deepspeed_gpu_loop

    tps = deepspeed_gpu_loop(cfg, vocab, steps, warmup)
    return with_mfu({"tokens_per_s": tps, "steps": steps, "warmup": warmup, "compiled": cfg.model.compile is True,
                     "what": "eager, full logits + F.cross_entropy, DeepSpeed bf16 ZeRO-1 + torch fused AdamW"},
                    fpt, True)


def plain_compile_loop(cfg, vocab: int, steps: int, warmup: int, cuda: bool, fpt: float) -> dict:
    """(c) What a person would write: the same Hugging Face model (raytrain.model.build_model) in bf16 on the GPU,
    model.compile(), torch's fused AdamW, logits -> F.cross_entropy, gradient clipping; random ids already on the
    device. No DeepSpeed: bf16 weights and optimizer state, no fp32 master copy (less work than mixed precision)."""
    import torch
    import torch.nn.functional as F

    from raytrain.model import build_model, param_groups

    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    t = time.time()
    model = build_model(cfg.model, vocab, cfg.run.seed, ds_config={"bf16": {"enabled": True}} if cuda else None)
    model.to(dev).train()
    built_s = time.time() - t
    if cuda:
        model.compile()
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            fused=True)
    mb, seq = cfg.batch.micro_batch_size, cfg.model.seq_len
    x = torch.randint(0, vocab, (mb, seq + 1), device=dev)
    losses, t0 = [], None
    for i in range(steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return with_mfu({"tokens_per_s": (steps - warmup) * mb * seq / elapsed, "step_s": elapsed / (steps - warmup),
                     "steps": steps, "warmup": warmup, "compiled": "whole model" if cuda else "no (CPU smoke)",
                     "build_s": round(built_s, 1), "loss_first": float(losses[0]), "loss_last": float(losses[-1])},
                    fpt, cuda)


def ratios(rec: dict) -> dict:
    def tps(key):
        m = rec.get(key)
        return m.get("tokens_per_s") if isinstance(m, dict) else None

    a = tps("step_path")
    return {f"step_path/{k}": (a / tps(k) if a and tps(k) else None) for k in ("frozen_deepspeed", "plain_compile")}


def part_model(c: Child, shape: str, *, frozen_s: float, compile_s: float, frozen_first: bool) -> None:
    """Parts gpt2_124m and llama_1b: the step path, then the baselines, each sized to ~4 s of timed steps."""
    cfg, vocab = config(shape, c.smoke)
    params, fpt = model_flops(cfg, vocab)
    tokens = cfg.batch.micro_batch_size * cfg.accumulation * cfg.model.seq_len
    steps = 6 if c.smoke else sized_steps(fpt, tokens, ASSUMED_MFU, 3.0, 10, 40)
    warmup = 2 if c.smoke else (3 if steps <= 15 else 5)
    c.rec.update({"params": params, "flops_per_token": fpt, "tokens_per_step": tokens, "peak_flops": PEAK_FLOPS,
                  "shape": SHAPES[shape + ("-smoke" if c.smoke else "")][0]})
    if c.cuda:
        import torch

        c.rec["device"] = torch.cuda.get_device_name()
    c.measure("step_path", lambda: step_path_measure(cfg, vocab, warmup + steps, warmup, c.cuda, fpt))
    sp = c.rec["step_path"]
    if "error" in sp and "OutOfMemory" in sp["error"] and cfg.batch.micro_batch_size > 1:
        half = cfg.batch.micro_batch_size // 2  # once: the micro-batch that fits, said in the record
        cfg, _ = config(shape, c.smoke, f"batch.micro_batch_size={half}")
        c.rec["step_path_oom_at_micro_batch"] = c.rec.pop("step_path")
        c.measure("step_path", lambda: step_path_measure(cfg, vocab, warmup + steps, warmup, c.cuda, fpt))
    baselines = [("frozen_deepspeed", frozen_s), ("plain_compile", compile_s)]
    if not frozen_first:
        baselines.reverse()
    for key, needs in baselines:
        if key == "frozen_deepspeed":
            if not c.cuda:
                c.rec[key] = {"skipped": "GPU only (NCCL, bf16)"}
                continue
            c.measure(key, lambda: frozen_deepspeed_measure(cfg, vocab, steps, warmup, fpt), needs_s=needs)
        else:
            c.measure(key, lambda: plain_compile_loop(cfg, vocab, warmup + steps, warmup, c.cuda, fpt),
                      needs_s=needs)
        c.rec["ratios"] = ratios(c.rec)
        c.save()


def local_memory_tier():
    """MemoryTier (raytrain/ckpt/host_snapshots.py) with its two generation files made here, as the node actor
    (NodeMemory.segment, a Ray actor) makes them, and no peer copy (one node): everything else - the capture, the
    copy on a CUDA side stream into page-locked shared memory, settle, the `auto` interval - is MemoryTier's."""
    from raytrain.ckpt.host_snapshots import MemoryTier

    class LocalMemoryTier(MemoryTier):
        def __init__(self, *args, directory: str, **kw):
            super().__init__(*args, **kw)
            self.directory = directory

        def _path(self, gen: int, nbytes: int):
            if self._sizes.get(gen, 0) >= nbytes:
                return self._paths[gen]
            want = int(nbytes * 1.02) + 2**20  # MemoryTier._path's headroom
            st = os.statvfs(self.directory)
            if want - self._sizes.get(gen, 0) > st.f_bavail * st.f_frsize:
                self._off(f"{want / 2**20:,.1f} MiB would exceed the free space of {self.directory}")
                return None
            path = os.path.join(self.directory, f"r{self.rank}-g{gen}")
            with open(path, "ab") as f:
                f.truncate(want)
            if gen in self._maps:
                self._maps.pop(gen).close()
            self._paths[gen], self._sizes[gen], self.bytes = path, want, max(self.bytes, want)
            return path

        def _replicate(self, path: str, step: int) -> None:
            pass  # a peer copy goes to another node's actor: one node here

    return LocalMemoryTier


def part_snapshots(c: Child) -> None:
    import shutil

    import numpy as np
    import torch

    from benchkit.step_path import counting_rows, init_single_rank
    from raytrain.ckpt.state import TrainState
    from raytrain.ds_config import build_ds_config
    from raytrain.model import build_model
    from raytrain.quiet import quiet_deepspeed
    from raytrain.worker.engine import make_engine
    from raytrain.worker.loss import StepLoss

    cfg, vocab = config("gpt2", c.smoke, "checkpoint.memory_peer_every_n_steps=0")
    params, fpt = model_flops(cfg, vocab)
    need = 2 * (12 * params * 1.02 + 2**20)  # two generations of fp32 weights + Adam m, v (ZeRO on one rank)
    shm = cfg.checkpoint.memory_dir
    st = os.statvfs(shm)
    free = st.f_bavail * st.f_frsize
    c.rec.update({"params": params, "memory_dir": shm, "memory_dir_free_gib": round(free / 2**30, 1),
                  "cadence": f"checkpoint.memory_every_n_steps={cfg.checkpoint.memory_every_n_steps}, "
                             f"memory_cost_target={cfg.checkpoint.memory_cost_target}"})
    if free < need * 1.1:
        c.rec["skipped"] = f"{shm} has {free / 2**30:.1f} GiB free, two generations need {need / 2**30:.1f} GiB"
        c.save()
        return
    c.rec["ray"] = ("not used: LocalMemoryTier makes the generation files itself (the node actor's job) and skips "
                    "the peer copy; capture, side-stream copy, settle and the auto interval are MemoryTier's")

    def measure() -> dict:
        quiet_deepspeed()
        init_single_rank("nccl" if c.cuda else "gloo")
        dev = torch.device("cuda", 0) if c.cuda else torch.device("cpu")
        if c.cuda:
            torch.cuda.set_device(dev)
        ds_config = build_ds_config(cfg, 1, "bf16" if c.cuda else "fp32", c.cuda)
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model, vocab, cfg.run.seed, ds_config=ds_config)
        engine, kernels = make_engine(model, cfg, ds_config=ds_config, cuda=c.cuda)
        mb, acc, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.model.seq_len
        per_step = mb * acc
        rows = counting_rows(per_step * 8, seq + 1, vocab)
        loss_fn = StepLoss(cfg.data, window=seq + 1, accumulation=acc, world=1, dp_size=1, device=dev)
        directory = tempfile.mkdtemp(prefix="gpu_check-", dir=shm)
        tier = local_memory_tier()(cfg.checkpoint, run_uri="gpu-check", rank=0, world=1, directory=directory)
        state = TrainState(world_size=1, global_batch=per_step)
        stalls: list[float] = []
        awaiting = [False]  # a GPU copy in flight: its stall is known once settle has run
        last_loss: list = []  # the previous step's loss on its way to pinned host memory (event, host tensor)

        def to_device(a: np.ndarray) -> torch.Tensor:  # as the worker's _to_device: pinned, non-blocking, int32
            x = torch.from_numpy(np.ascontiguousarray(a).astype(np.int32))
            return (x.pin_memory().to(dev, non_blocking=True) if c.cuda else x).long()

        def step(snap: bool) -> None:
            take = rows[(state.step * per_step) % len(rows):][:per_step]
            loss_fn.begin(take)
            total = torch.zeros((), device=dev)
            for a in range(acc):
                loss = loss_fn(engine, to_device(take[a * mb:(a + 1) * mb]))
                engine.backward(loss)
                if a == acc - 1:
                    tier.settle()  # the worker's place: before the optimizer step changes what a copy reads
                    if awaiting[0]:
                        stalls.append(tier.last_stall_s)
                        awaiting[0] = False
                engine.step()
                total += loss.detach().float()
            state.step += 1
            state.samples_seen += per_step
            state.tokens_seen += per_step * seq
            # As the worker's per-step agreement (worker/verdict.py): the loss goes to pinned host memory behind an
            # event and is read at the next step, without a host synchronisation on a steady step.
            if c.cuda:
                if last_loss:
                    ev, host = last_loss.pop()
                    ev.synchronize()
                    host.item()
                host = torch.empty((), dtype=total.dtype, pin_memory=True)
                host.copy_(total, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                last_loss.append((ev, host))
            else:
                float(total)
            if tier.interval.deciding(state.step):  # one rank: the agreed mean is this rank's proposal
                tier.interval.agreed(state.step, tier.interval.proposal())
            if snap:
                tier.snapshot(engine, state)
                if tier._took:
                    if tier._pending is not None:
                        awaiting[0] = True
                    else:
                        stalls.append(tier.last_stall_s)

        def window(n: int, snap: bool) -> float:
            if c.cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                step(snap)
            tier.settle()  # the window's last copy is its own
            if awaiting[0]:
                stalls.append(tier.last_stall_s)
                awaiting[0] = False
            if c.cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        try:
            tier.interval.begin(0)  # as the worker at an attempt's start: auto measures from the first step
            t = time.time()
            while tier.interval.decided_at is None and state.step < 40:
                step(True)
            decide_s = time.time() - t
            if not tier.enabled:
                raise RuntimeError("memory snapshots turned themselves off (see the log)")
            k = tier.interval.every
            step_s = tier.interval.step_s or 0.05
            w = k * max(1, round((0.3 if c.smoke else 1.5) / (k * step_s)))  # whole intervals, ~1.5 s a window
            fits = int((c.left() - 5) / (2 * step_s * 1.3))  # steps per window if one pair is all there is time for
            pairs = max(1, min(3, fits // w))
            w = min(w, max(1, fits))  # an interval longer than the time left: windows of fewer snapshots
            on_s = off_s = 0.0
            before = len(stalls)
            for _ in range(pairs):  # alternating, so both sides share whatever the machine does
                off_s += window(w, False)
                on_s += window(w, True)
            taken = len(stalls) - before
            tokens = pairs * w * per_step * seq
            on, off = tokens / on_s, tokens / off_s
            return {"kernels": kernels, "every": k, "interval": tier.interval.describe(),
                    "decided_at_step": tier.interval.decided_at, "decide_s": round(decide_s, 1),
                    "cost_s": tier.interval.cost_s, "step_s_measured": step_s, "window_steps": w, "pairs": pairs,
                    "snapshots_in_on_windows": taken,
                    "bytes_per_generation": tier.bytes, "pinned": {g: m.pinned for g, m in tier._maps.items()},
                    "tokens_per_s_on": on, "tokens_per_s_off": off, "ratio_on_off": on / off,
                    "mfu_off": fpt * off / PEAK_FLOPS if c.cuda else None,
                    "stalls_s": {"n": len(stalls), "median": float(np.median(stalls)) if stalls else None,
                                 "max": max(stalls) if stalls else None}}
        finally:
            tier.invalidate()  # waits for a copy still in flight (on an error) before its memory is unmapped
            for m in tier._maps.values():
                m.close()
            shutil.rmtree(directory, ignore_errors=True)

    m = c.measure("measurement", measure)
    if m and "ratio_on_off" in m:
        c.rec["ratio_on_off"], c.rec["every"] = m["ratio_on_off"], m["every"]
        c.save()


def run_child(args) -> int:
    c = Child(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed at the cap: clean-ups (finally) still run
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from raytrain.quiet import quiet_progress_bars, quiet_warnings

        quiet_warnings()
        quiet_progress_bars()
        if args.child == "gpt2_124m":
            part_model(c, "gpt2", frozen_s=15.0, compile_s=30.0, frozen_first=True)
        elif args.child == "snapshots_124m":
            part_snapshots(c)
        elif args.child == "llama_1b":
            part_model(c, "llama", frozen_s=30.0, compile_s=35.0, frozen_first=False)
        else:
            raise SystemExit(f"no part {args.child!r}")
    except Exception as e:  # noqa: BLE001 - set-up failed: recorded, the parent goes on with the next part
        c.rec["error"] = f"{type(e).__name__}: {e}"[:500]
        c.rec["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
        traceback.print_exc()
    c.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: NCCL's and the compile workers' exits can hang, and everything is saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="output folder")
    ap.add_argument("--plan", action="store_true", help="print the parts and their time caps (JSON) and exit")
    ap.add_argument("--cpu-smoke", action="store_true", help="every part at toy sizes on the CPU (no GPU needed)")
    ap.add_argument("--parts", default="", help="comma-separated subset of the parts, in plan order")
    ap.add_argument("--total-s", type=float, default=TOTAL_S, help="the whole run's budget (default %(default)s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan:
        print(json.dumps(plan(), indent=1))
        return 0
    if args.child:
        return run_child(args)
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_check: no CUDA device (torch {torch.__version__} sees none); run it on a GPU machine, "
                  "see docs/BENCHMARKS.md (or --cpu-smoke)", file=sys.stderr)
            return 2
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
