"""`raytrain check --url URL`: the HTTP launch check of a running `raytrain serve`, bounded in requests and time.

Over https, one TLS handshake first (the version negotiated; the server verified with --ca-bundle or the
system's trust store). Health; one predict (the cold request, when it is the replica's first); the OpenAI
endpoints (completions with echo and log-probabilities, a stream, chat); consistency (the echoed prompt log-probabilities of
/v1/completions for K held-out samples, one by one and as one list, against the offline model's, through
the offline evaluation's own loss function); a load test of N requests at concurrency C (threads, one keep-alive connection
each) reporting warm latency P50 / P95 / P99, throughput and errors. Writes launch_check.json and
launch_check.md. Passes only with no failed request, consistency within tolerance and P99 within the bar.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

FALLBACK_TEXTS = ["The quick brown fox jumps over the lazy dog.", "one two three four five six",
                  "Ray Serve answers HTTP requests.", "A short sentence to score."]


class Client:
    """One keep-alive HTTP(S) connection (per thread in the load test); https verified with `context` (default:
    the system's trust store)."""

    def __init__(self, url: str, timeout_s: float, context: Optional[ssl.SSLContext] = None):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            from raytrain.errors import UserError

            raise UserError(f"--url {url!r}: give the server's address, e.g. http://127.0.0.1:8000")
        self.host, self.port, self.https = u.hostname, u.port or (443 if u.scheme == "https" else 80), u.scheme == "https"
        self.prefix, self.timeout_s, self.conn = u.path.rstrip("/"), timeout_s, None
        self.context = context

    def request(self, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any, float]:
        """(status, JSON body or {"error": ...}, seconds). Status 0: the connection failed. A server-sent
        event stream comes back as the list of its `data:` payloads (JSON, or the closing "[DONE]")."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        t = time.perf_counter()
        for attempt in (0, 1):  # a keep-alive connection the server closed in between is reopened once
            try:
                if self.conn is None:
                    if self.https:
                        self.conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                                context=self.context)
                    else:
                        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
                self.conn.request(method, self.prefix + path, body=data, headers=headers)
                r = self.conn.getresponse()
                raw = r.read()
                if r.getheader("content-type", "").startswith("text/event-stream"):
                    events = [x[len("data: "):] for x in raw.decode().split("\n\n") if x.startswith("data: ")]
                    return r.status, [e if e == "[DONE]" else json.loads(e) for e in events], time.perf_counter() - t
                try:
                    out = json.loads(raw)
                except ValueError:
                    out = {"error": raw[:200].decode(errors="replace")}
                return r.status, out, time.perf_counter() - t
            except (http.client.HTTPException, OSError) as e:
                self.conn.close()
                self.conn = None
                if attempt or not isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    return 0, {"error": f"{type(e).__name__}: {e}"}, time.perf_counter() - t
        raise AssertionError("unreachable")


def held_out_texts(data: Optional[str], tokenizer, context: int, k: int) -> tuple[list[str], str]:
    """K texts from the held-out split (decoded token rows, short enough to score), or fixed texts when
    there is no split to read. Returns (texts, where they came from)."""
    if data:
        from raytrain.data.manifest import load_split
        from raytrain.data.reader import read_rows

        split = load_split(data, "--data")
        rows = read_rows(split, 0, min(k, split.num_samples))
        rows = rows[:, :split.seq_len + 1]  # fine-tuning splits: the tokens column only
        texts, origin = [tokenizer.decode(list(r)) for r in rows], split.uri
    else:
        texts, origin = FALLBACK_TEXTS[:k], "built-in sentences (no held-out split known: pass --data)"
    return cut(tokenizer, texts, context), origin


def cut(tokenizer, texts: list[str], room: int) -> list[str]:
    """Each text cut to three quarters of `room` tokens: re-tokenizing decoded text may merge differently and
    must still fit."""
    n = max(2, room * 3 // 4)
    return [tokenizer.decode(tokenizer(t, verbose=False)["input_ids"][:n]) for t in texts]


def offline_logprobs(model, tokenizer, text: str) -> list[float]:
    """The offline evaluation's numbers for one text: -cross entropy per next token (raytrain eval's loss)."""
    import torch

    from raytrain.worker.evaluate import lm_loss

    ids = torch.tensor([tokenizer(text, verbose=False)["input_ids"]])
    with torch.no_grad():
        return (-lm_loss(model, ids, reduction="none")).tolist()


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None}
    a = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "p99_ms": float(np.percentile(a, 99))}


def run_url_check(url: str, *, model: Optional[str] = None, data: Optional[str] = None, k: int = 8,
                  requests: int = 200, concurrency: int = 8, max_p99_ms: float = 500.0, tol: float = 1e-4,
                  prompt: str = "one two three", max_new_tokens: int = 16, timeout_s: float = 300.0,
                  out_dir: Optional[str] = None, ca_bundle: Optional[str] = None,
                  log: Callable[[str], None] = print) -> dict:
    """{"ok", "checks": [{name, ok, detail}], figures...}; never raises on a failed check. An https URL's server
    is verified with `ca_bundle` (default: the system's trust store); a certificate that cannot be verified is
    no failed check but a UserError (one line: pass --ca-bundle)."""
    chk = UrlCheck(url, timeout_s=timeout_s, log=log, ca_bundle=ca_bundle)
    chk.tls()
    if chk.reachable():
        chk.predict(prompt, max_new_tokens)
        chk.openai(prompt, max_new_tokens)
        texts, tok = chk.consistency(model, data, k=k, tol=tol)
        chk.load(texts, tok, requests=requests, concurrency=concurrency, max_new_tokens=max_new_tokens,
                 max_p99_ms=max_p99_ms)
    return chk.finish(out_dir)


class UrlCheck:
    """The launch checks of a running server, one method each; every check is recorded, none raises."""

    def __init__(self, url: str, *, timeout_s: float, log: Callable[[str], None], ca_bundle: Optional[str] = None):
        from raytrain.serving.run import client_context

        self.url, self.timeout_s, self.log, self.ca_bundle = url, timeout_s, log, ca_bundle
        https = urllib.parse.urlsplit(url).scheme == "https"
        if ca_bundle and not https:
            from raytrain.errors import UserError

            raise UserError(f"check: --ca-bundle is for an https:// --url, not {url}")
        self.context = client_context(ca_bundle, "check") if https else None
        self.deadline = time.monotonic() + timeout_s
        self.checks: list[dict] = []
        self.out: dict = {"url": url, "checks": self.checks}
        self.client = Client(url, timeout_s=min(60.0, timeout_s), context=self.context)
        self.served: dict = {}
        self.stable: Optional[str] = None

    def record(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        self.log(f"{'PASS' if ok else 'FAIL'}  {name:12} {detail}")
        return ok

    def finish(self, out_dir: Optional[str]) -> dict:
        self.out["ok"] = bool(self.checks) and all(c["ok"] for c in self.checks)
        if out_dir:
            self.out["reports"] = write_reports(self.out, out_dir)
        return self.out

    def tls(self) -> None:
        """https: one handshake, recorded with the negotiated version and cipher; a certificate that cannot be
        verified raises a UserError (a setting to fix, not a failed check); an unreachable server is left to the
        health check."""
        if self.context is None:
            return
        from raytrain.errors import UserError
        from raytrain.serving.run import tls_error

        host, port = self.client.host, self.client.port
        try:
            with socket.create_connection((host, port), timeout=min(60.0, self.timeout_s)) as raw, \
                    self.context.wrap_socket(raw, server_hostname=host) as s:
                version, cipher = s.version(), s.cipher()[0]
        except ssl.SSLError as e:
            raise UserError(f"check --url {self.url}: {tls_error(e)}") from None
        except OSError:
            return
        self.out["tls"] = {"version": version, "cipher": cipher}
        self.record("tls", version == "TLSv1.3" or version == "TLSv1.2",
                    f"{version} ({cipher}), certificate verified with "
                    f"{self.ca_bundle or 'the system trust store'}")

    def reachable(self) -> bool:
        """/healthz answers and /v1/models lists the stable version."""
        status, body, _ = self.client.request("GET", "/healthz")
        if not self.record("health", status == 200 and body.get("status") == "ok", f"GET /healthz -> {status} {body}"):
            return False
        status, models, _ = self.client.request("GET", "/v1/models")
        self.served = {m["version"]: m for m in models.get("data", [])} if status == 200 else {}
        self.stable = body.get("stable")
        self.out["versions"] = self.served
        return self.record("models", self.stable in self.served, f"GET /v1/models -> {status}: " + ", ".join(
            f"{v} ({m['role']}, {m['params']:,} params, step {m['step']}, lineage {m.get('lineage')})"
            for v, m in self.served.items()))

    def predict(self, prompt: str, max_new_tokens: int) -> None:
        status, res, dt = self.client.request("POST", "/predict", {"text": prompt, "max_new_tokens": max_new_tokens})
        self.out["cold_ms"], self.out["cold_was_first"] = dt * 1e3, bool(res.get("cold"))
        warmth = "the replica's first request" if res.get("cold") else "replica already warm"
        self.record("predict", status == 200 and "continuation" in res and isinstance(res.get("logprobs"), list),
                    f"POST /predict {prompt!r} -> {status} in {dt * 1e3:.0f} ms ({warmth}), "
                    f"version {res.get('version')}: {res.get('continuation', res.get('error'))!r}")

    def echoed(self, version: str, prompt) -> list[tuple[int, Optional[list], str]]:
        """(status, served log-probabilities of each prompt token after the first, error) per prompt, from
        /v1/completions with echo and max_tokens 0."""
        status, res, _ = self.client.request("POST", "/v1/completions", {"model": version, "prompt": prompt,
                                                                        "max_tokens": 0, "echo": True, "logprobs": 0})
        n = len(prompt) if isinstance(prompt, list) else 1
        if status != 200:
            return [(status, None, str(res.get("error", {}).get("message", res)) if isinstance(res, dict) else "")] * n
        return [(status, c["logprobs"]["token_logprobs"][1:], "") for c in res["choices"]]

    def openai(self, prompt: str, max_new_tokens: int) -> None:
        """Completions with echo and log-probabilities, a stream equal to the unstreamed text, and chat."""
        base = {"model": self.stable, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.8, "seed": 1}
        status, res, dt = self.client.request("POST", "/v1/completions", {**base, "echo": True, "logprobs": 1})
        choice = res["choices"][0] if status == 200 else {}
        lp = choice.get("logprobs") or {}
        self.record("echo", status == 200 and choice.get("text", "").startswith(prompt) and
                    (lp.get("token_logprobs") or [0])[0] is None and "".join(lp.get("tokens", [])) == choice.get("text"),
                    f"POST /v1/completions echo + logprobs -> {status} in {dt * 1e3:.0f} ms: "
                    f"{len(lp.get('tokens', []))} tokens scored" + ("" if status == 200 else f" ({res})"))
        status, events, dt = self.client.request("POST", "/v1/completions", {**base, "stream": True})
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1]) if status == 200 else None
        text = choice.get("text", "")[len(prompt):]
        self.record("stream", status == 200 and events[-1] == "[DONE]" and streamed == text,
                    f"POST /v1/completions stream -> {status} in {dt * 1e3:.0f} ms: "
                    f"{len(events) if status == 200 else 0} events, text {'equal to' if streamed == text else 'unlike'} "
                    "the unstreamed one")
        status, res, dt = self.client.request("POST", "/v1/chat/completions", {
            # A few tokens: the rendered conversation is longer than the prompt, and must fit small contexts too.
            "model": self.stable, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
        msg = res["choices"][0]["message"] if status == 200 else {}
        self.record("chat", status == 200 and msg.get("role") == "assistant" and isinstance(msg.get("content"), str),
                    f"POST /v1/chat/completions -> {status} in {dt * 1e3:.0f} ms: {msg.get('content', res)!r}")

    def consistency(self, model: Optional[str], data: Optional[str], *, k: int, tol: float) -> tuple[list, object]:
        """Pinned to the stable version, scored against that version's exported model offline; returns the
        held-out texts and the tokenizer (for the load test)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from raytrain.export import EXPORT_META
        from raytrain.model import local_model_dir

        stable = self.stable
        try:
            local = local_model_dir(model or self.served[stable]["source"])
            offline = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(local)
            meta_path = os.path.join(local, EXPORT_META)
            meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
            texts, origin = held_out_texts(data or meta.get("val_data"), tok, self.served[stable]["context"], k)
        except Exception as e:  # noqa: BLE001 - an unreadable offline model is a failed check, said in one line
            self.record("consistency", False, f"cannot load the offline model {model or self.served[stable]['source']}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (pass the exported directory "
                        "as MODEL_DIR)")
            return [], None
        worst, bad = 0.0, []
        wants = [offline_logprobs(offline, tok, text) for text in texts]
        served = [self.echoed(stable, text)[0] for text in texts] + (self.echoed(stable, texts) if texts else [])
        for (status, got, err), want in zip(served, wants + wants):
            if got is None or len(got) != len(want):
                bad.append(f"{status} {err} ({len(got or [])} vs {len(want)} tokens)")
                continue
            worst = max(worst, max((abs(a - b) for a, b in zip(got, want)), default=0.0))
        if texts:
            self.out["consistency_max_abs_diff"] = worst
            self.record("consistency", not bad and worst <= tol, f"{len(texts)} samples from {origin} (one by one and as one list, POST /v1/completions echo), "
                        f"version {stable}: "
                        f"max |served - offline| log-prob {worst:.2e} (limit {tol:g})" + (f"; failed: {bad[:2]}" if bad else ""))
        return texts, tok

    def load(self, texts: list, tok, *, requests: int, concurrency: int, max_new_tokens: int,
             max_p99_ms: float) -> None:
        """Warm latency, throughput, errors; bounded by the request count and the deadline."""
        load_texts = FALLBACK_TEXTS
        if texts:  # the held-out texts, cut so that each fits the context with its generated tokens
            load_texts = cut(tok, texts, self.served[self.stable]["context"] - max_new_tokens)
        lat: list[float] = []
        errors: list[str] = []
        versions: dict[str, int] = {}
        lock = threading.Lock()
        local_clients = threading.local()

        def one(i: int) -> None:
            if time.monotonic() > self.deadline:
                return
            cl = getattr(local_clients, "c", None) or Client(self.url, timeout_s=min(60.0, self.timeout_s),
                                                             context=self.context)
            local_clients.c = cl
            s, r, d = cl.request("POST", "/predict", {"text": load_texts[i % len(load_texts)],
                                                      "max_new_tokens": max_new_tokens})
            with lock:
                if s == 200:
                    lat.append(d)
                    versions[r.get("version")] = versions.get(r.get("version"), 0) + 1
                else:
                    errors.append(f"{s} {r.get('error', '')}"[:200])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            list(pool.map(one, range(requests)))
        wall = time.perf_counter() - t0
        done = len(lat) + len(errors)
        ld = self.out["load"] = {
            "requests": requests, "completed": done, "concurrency": concurrency, "wall_s": wall, "ok": len(lat),
            "errors": len(errors), "error_samples": errors[:5], "versions": versions,
            "throughput_rps": done / wall if wall > 0 else None,
            "tokens_per_s": len(lat) * max_new_tokens / wall if wall > 0 else None, **_pct(lat)}
        self.record("load", not errors and done == requests,
                    f"{done}/{requests} requests at concurrency {concurrency} in {wall:.1f}s: {ld['throughput_rps']:.1f} "
                    f"req/s, {len(errors)} errors" + (f" ({errors[0]})" if errors else "") + f", versions {versions}")
        p99 = ld["p99_ms"]
        self.record("latency", p99 is not None and p99 <= max_p99_ms,
                    f"warm p50 {ld['p50_ms'] or 0:.0f} ms, p95 {ld['p95_ms'] or 0:.0f} ms, p99 {p99 or 0:.0f} ms "
                    f"(limit {max_p99_ms:g} ms); cold {self.out['cold_ms']:.0f} ms")


def write_reports(out: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    js, md = os.path.join(out_dir, "launch_check.json"), os.path.join(out_dir, "launch_check.md")
    with open(js, "w") as f:
        json.dump(out, f, indent=1)
    ld = out.get("load", {})

    def ms(v):
        return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

    lines = [f"# Launch check: {out['url']}", "", f"**{'PASSED' if out.get('ok') else 'FAILED'}** "
             f"({time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime())})", "", "| check | result | detail |",
             "| --- | --- | --- |"]
    lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail'].replace('|', '/')} |" for c in out["checks"]]
    if ld:
        lines += ["", "| latency | ms |", "| --- | --- |", f"| cold (first request) | {ms(out.get('cold_ms'))} |",
                  f"| warm p50 | {ms(ld.get('p50_ms'))} |", f"| warm p95 | {ms(ld.get('p95_ms'))} |",
                  f"| warm p99 | {ms(ld.get('p99_ms'))} |", "",
                  f"Throughput {ms(ld.get('throughput_rps'))} requests/s ({ms(ld.get('tokens_per_s'))} generated "
                  f"tokens/s) at concurrency {ld.get('concurrency')}; {ld.get('errors')} errors of "
                  f"{ld.get('completed')} requests; versions answering: {ld.get('versions')}."]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [js, md]
