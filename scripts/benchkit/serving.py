"""Part `serve`: latency of `raytrain serve` over HTTP against a plain `transformers` generate loop in one process.

The model is the demo's (the `tiny` recipe's GPT-2 on the python-docs tokenizer, untrained: latency does not
depend on the weights, and greedy decoding gives both sides the same tokens). Both sides get the same prompts
(the first 32 tokens of prepared rows), the same `max_tokens`, greedy decoding, and one CPU thread for the
model (a replica is scheduled with num_cpus=1). At concurrency 1 the baseline generates one prompt at a time;
at concurrency 8 it generates eight prompts per `generate()` call (left padding, as the replica's batches
do), each request's latency being its batch's. Cold is the first request after deploy (server) or after the
model is loaded (baseline); warm figures come after a few warm-up requests. The server runs as a user runs
it, `raytrain serve MODEL` in its own process with its own local Ray, and is stopped before the next side;
the baseline runs once before and once after it (fresh processes), pooled: load from others drifts.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS, MAX_TOKENS, CONCURRENCY = 32, 32, (1, 8)


def demo_model(tmp: str, data: str) -> str:
    """The demo's model shape on the demo's tokenizer, saved as an exported model directory."""
    from benchkit.parts import train_cfg
    from raytrain.data.manifest import load_split
    from raytrain.export import hf_tokenizer
    from raytrain.model import build_model

    out = os.path.join(tmp, "serve-model")
    if not os.path.exists(os.path.join(out, "config.json")):
        cfg = train_cfg(data, os.path.join(tmp, "runs"), "serve", 1, 1, 1)
        split = load_split(cfg.data.train)
        build_model(cfg.model, split.vocab_size, 0, split.eot_id).save_pretrained(out)
        hf_tokenizer(split.tokenizer_uri, cfg.model.seq_len, split.eot_id).save_pretrained(out)
    return out


def prompts(model_dir: str, data: str, n: int) -> list[str]:
    """n prompts: the first PROMPT_TOKENS tokens of prepared rows, decoded."""
    from transformers import AutoTokenizer

    from raytrain.data.manifest import load_split
    from raytrain.data.reader import read_rows

    split = load_split(f"{data}/train")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = read_rows(split, 0, min(n, split.num_samples))
    texts = [tok.decode(list(r[:PROMPT_TOKENS])) for r in rows]
    return (texts * (n // len(texts) + 1))[:n]


def stats(latencies_s: list[float], wall_s: float) -> dict:
    a = np.asarray(latencies_s) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "rps": len(latencies_s) / wall_s, "n": len(latencies_s)}


# ------------------------------------------------------------------------------------------ baseline

def plain_loop(model_dir: str, texts: list[str], warmup: int) -> dict:
    """The baseline, run in a fresh process: load, one cold generate, warm-up, then each concurrency."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    load_s = time.perf_counter() - t0
    eot = tok.eos_token_id

    def generate(batch: list[str]) -> list[str]:
        enc = tok(batch, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=eot,
                                 eos_token_id=eot)
        return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    t = time.perf_counter()
    generate(texts[:1])
    res = {"load_s": load_s, "cold_ms": (time.perf_counter() - t) * 1e3}
    for text in texts[:warmup]:
        generate([text])
    for c in CONCURRENCY:
        lat, texts_out, start = [], [], time.perf_counter()
        for i in range(0, len(texts), c):
            t = time.perf_counter()
            texts_out += generate(texts[i:i + c])
            lat += [time.perf_counter() - t] * len(texts[i:i + c])
        res[c] = {**stats(lat, time.perf_counter() - start), "texts": texts_out, "latencies_s": lat}
    return res


def pooled(runs: list[dict]) -> dict:
    """The baseline's runs before and after the server's as one: load from other processes drifts, and
    the two together bracket the server's run (latencies pooled, requests/s and cold averaged)."""
    out = {"cold_ms": float(np.mean([r["cold_ms"] for r in runs])), "load_s": float(np.mean([r["load_s"] for r in runs])),
           "runs": [{k: v for k, v in r.items() if k not in CONCURRENCY} for r in runs]}
    for c in CONCURRENCY:
        lat = [x for r in runs for x in r[c]["latencies_s"]]
        out[c] = {**stats(lat, 1.0), "rps": float(np.mean([r[c]["rps"] for r in runs])), "texts": runs[0][c]["texts"],
                  "rps_runs": [r[c]["rps"] for r in runs]}
    return out


# ------------------------------------------------------------------------------------------- server

def _start_server(model_dir: str, tmp: str, port: int) -> tuple[subprocess.Popen, float]:
    ready = Path(tmp) / "serve-ready.json"
    ready.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    log = open(Path(tmp) / "serve.log", "w")
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain", "serve", model_dir, "--port", str(port),
                             "--ready-file", str(ready)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    deadline = time.time() + 600
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"raytrain serve did not come up: {(Path(tmp) / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, time.perf_counter() - t


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def served(model_dir: str, texts: list[str], warmup: int, tmp: str) -> dict:
    """The same measurements against `raytrain serve` over HTTP (/v1/completions, one keep-alive connection
    per client thread)."""
    from raytrain.serving.check import Client
    from tests.helpers import free_port

    port = free_port()
    proc, ready_s = _start_server(model_dir, tmp, port)
    url = f"http://127.0.0.1:{port}"

    def ask(client: Client, text: str) -> tuple[float, str]:
        status, body, dt = client.request("POST", "/v1/completions", {"prompt": text, "max_tokens": MAX_TOKENS,
                                                                      "temperature": 0})
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {json.dumps(body)[:300]}")
        return dt, body["choices"][0]["text"]

    try:
        res = {"ready_s": ready_s}
        first = Client(url, 300)
        res["cold_ms"] = ask(first, texts[0])[0] * 1e3
        for text in texts[:warmup]:
            ask(first, text)
        for c in CONCURRENCY:
            clients = [Client(url, 300) for _ in range(c)]
            per = [texts[k::c] for k in range(c)]
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=c) as pool:
                outs = list(pool.map(lambda k: [ask(clients[k], t) for t in per[k]], range(c)))
            wall = time.perf_counter() - start
            lat = [dt for o in outs for dt, _ in o]
            by_text = {}
            for k in range(c):
                for i, (_, out) in zip(range(k, len(texts), c), outs[k]):
                    by_text[i] = out
            res[c] = {**stats(lat, wall), "texts": [by_text[i] for i in range(len(texts))]}
        return res
    finally:
        _stop(proc)


def serve(tmp: str, data: str, quick: bool, log: Callable = print) -> list[dict]:
    from benchkit.parts import figure, measured

    n, warmup = (48, 8) if quick else (200, 16)
    model_dir = demo_model(tmp, data)
    texts = prompts(model_dir, data, n)
    def baseline() -> dict:
        with mp.get_context("spawn").Pool(1) as pool:  # a fresh process: its first generate() is really cold
            return pool.apply(plain_loop, (model_dir, texts, warmup))

    before = baseline()
    srv = served(model_dir, texts, warmup, tmp)
    base = pooled([before, baseline()])
    figs = [figure("9 serve", "cold: first request after deploy", srv["cold_ms"], "ms",
                   "plain generate, first call after loading", measured(base["cold_ms"]), target="(kept apart from warm)",
                   server_ready_s=srv["ready_s"], baseline_load_s=base["load_s"])]
    log(f"  cold: raytrain serve {srv['cold_ms']:.1f} ms (deploy to ready {srv['ready_s']:.1f} s) | plain "
        f"{base['cold_ms']:.1f} ms (load {base['load_s']:.1f} s)")
    for c in CONCURRENCY:
        s, b = srv[c], base[c]
        same = sum(x == y for x, y in zip(s["texts"], b["texts"])) / len(texts)
        log(f"  concurrency {c}, warm, {n} requests of {PROMPT_TOKENS} + {MAX_TOKENS} tokens: raytrain serve "
            f"P50 {s['p50_ms']:.1f} ms P99 {s['p99_ms']:.1f} ms {s['rps']:.1f} req/s | plain P50 {b['p50_ms']:.1f} "
            f"ms P99 {b['p99_ms']:.1f} ms {b['rps']:.1f} req/s | ratios {s['p50_ms'] / b['p50_ms']:.2f} / "
            f"{s['p99_ms'] / b['p99_ms']:.2f} / {s['rps'] / b['rps']:.2f} (same text {same:.0%})")
        base_name = "plain generate, one prompt per call" if c == 1 else f"plain generate, {c} prompts per call"
        for key, name, unit, target in (("p50_ms", "P50 latency", "ms", ""), ("p99_ms", "P99 latency", "ms",
                                                                               "<= 500 ms" if c == 1 else ""),
                                        ("rps", "requests/s", "req/s", "")):
            met = None if not target else s[key] <= 500
            figs.append(figure("9 serve", f"{name}, concurrency {c}, warm", s[key], unit, base_name, measured(b[key]),
                               target=target, met=met, requests=n, same_text=same, max_tokens=MAX_TOKENS,
                               baseline_rps_runs=b["rps_runs"]))
    return figs
