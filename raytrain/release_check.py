"""`raytrain check MODEL_DIR`: the launch gate for an exported model. Exit 0 only if every check passes.

Checks: the directory loads with stock `transformers` (model and tokenizer); the parameter count is the
expected one (--expect-params, else the count recorded at export); a short generation produces tokens;
p50 / p99 latency over N generations (optionally bounded with --max-p99-ms); optionally perplexity on
held-out data against what training reported (--data).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np
import torch


def run_checks(model_dir: str, *, expect_params: Optional[int] = None, prompt: str = "The", n: int = 20,
               max_new_tokens: int = 16, max_p99_ms: Optional[float] = None, data: Optional[str] = None,
               max_loss_diff: float = 1e-3) -> dict:
    """{"ok": bool, "checks": [{name, ok, detail}], plus the figures}. Never raises on a failed check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raytrain.export import EXPORT_META
    from raytrain.model import local_model_dir, param_count

    checks: list[dict] = []
    out: dict = {"model": model_dir, "checks": checks}

    def record(name: str, ok: bool, detail: str) -> bool:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return ok

    try:
        local = local_model_dir(model_dir)
        model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(local)
    except Exception as e:  # noqa: BLE001 - any load failure is a failed gate, reported as such
        record("load", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        out["ok"] = False
        return out
    record("load", True, f"{type(model).__name__} + {type(tok).__name__} with stock transformers")
    meta_path = os.path.join(local, EXPORT_META)
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}

    n_params = out["params"] = param_count(model)
    expected = expect_params if expect_params is not None else meta.get("params")
    if expected is None:
        record("params", False, f"{n_params:,} parameters, but nothing to compare with: pass --expect-params")
    else:
        record("params", n_params == expected, f"{n_params:,} parameters, expected {expected:,}")

    enc = tok(prompt, return_tensors="pt")
    eot = tok.eos_token_id
    lat = []
    with torch.no_grad():
        for i in range(n + 1):  # the first one warms up (allocation, lazy init) and is not timed
            t = time.perf_counter()
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=eot)
            if i:
                lat.append((time.perf_counter() - t) * 1e3)
    new = gen[0, enc["input_ids"].shape[1]:]
    out["sample"] = tok.decode(new)
    record("generate", len(new) == max_new_tokens, f"{len(new)} new tokens for {prompt!r}: {out['sample']!r}")
    out["p50_ms"], out["p99_ms"] = float(np.percentile(lat, 50)), float(np.percentile(lat, 99))
    record("latency", max_p99_ms is None or out["p99_ms"] <= max_p99_ms,
           f"p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms over {n} generations of {max_new_tokens} tokens"
           + (f" (limit p99 {max_p99_ms:g} ms)" if max_p99_ms is not None else ""))

    if data:
        from raytrain.config import Config
        from raytrain.data.manifest import load_split
        from raytrain.evaluation import eval_rows, loss_sums

        cfg = Config.model_validate(meta["config"]).largest() if "config" in meta else None
        mb, world = (cfg.batch.micro_batch_size, cfg.scaling.num_workers) if cfg else (8, 1)
        split = load_split(data, "--data")
        rows = eval_rows(split, cfg.data.eval_samples if cfg else 512, mb, world)
        total, count = loss_sums(model, rows, mb, window=split.seq_len + 1,  # fine-tuning splits: the training mask
                                 document_mask=cfg.data.document_mask if cfg else True)
        out["val_loss"] = total / count
        reported = (meta.get("reported") or {}).get("val_loss")
        if reported is None:
            record("perplexity", False, f"val loss {out['val_loss']:.6f}; no training-reported value to compare with")
        else:
            diff = abs(out["val_loss"] - reported)
            record("perplexity", diff <= max_loss_diff, f"val loss {out['val_loss']:.6f}, training reported "
                   f"{reported:.6f} (|diff| {diff:.1e}, limit {max_loss_diff:g})")
    out["ok"] = all(c["ok"] for c in checks)
    return out
