"""The Ray Serve application of `raytrain serve` (replica side).

A `Router` ingress parses HTTP (the OpenAI endpoints through `openai_api`), answers bad input with a 4xx
and a one-line reason (an OpenAI error object on /v1/*), splits traffic
between a stable and an optional canary version, and records per-version metrics; one `ModelServer`
deployment per version holds the model and batches requests (`@serve.batch`). Both versions stay up
while traffic moves between them, so a canary change, a promotion or a rollback never fails a request.

The router is one replica (it only parses and dispatches; the model deployments are what scale), so the
traffic split lives in its memory and changes at once for every request after an admin call. It also keeps the
deployment's audit records (raytrain/audit.py): deploy, each traffic change, and one record per generation
request (digests and lengths of prompt and completion; their text only with `audit_text`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any, Optional

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from raytrain.audit import AuditWriter, text_fields
from raytrain.serving import openai_api, streaming
from raytrain.serving.fields import RequestError, int_field

APP_NAME = "raytrain"
DEFAULT_NEW_TOKENS = openai_api.DEFAULT_NEW_TOKENS
LATENCY_BOUNDARIES_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000]
# The serving series as Prometheus sees them once observability/prometheus.yml strips Ray's `ray_` prefix.
ENDPOINTS = ("/predict", "/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz")
SERVING_METRICS = {"model_requests_total", "model_request_latency_ms", "model_generated_tokens_total"}
GENERATION = ("/predict", "/v1/completions", "/v1/chat/completions")  # the endpoints audited per request
ADMIN_EVENTS = {"/admin/traffic": "traffic", "/admin/promote": "promote", "/admin/rollback": "rollback"}


# --- model replicas -----------------------------------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
class ModelServer:
    """One version of the model: a continuation and log-probabilities (top-k on request) of prompt and
    continuation, batched across requests."""

    def __init__(self, uri: str, version: str, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.005, *,
                 chat_template: str = "default"):
        import ray
        import torch

        from raytrain.quiet import quiet_progress_bars

        quiet_progress_bars()  # before transformers' import: a bar per replica start in the serve console
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from raytrain.export import EXPORT_META
        from raytrain.lineage import model_id
        from raytrain.model import local_model_dir, param_count

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        torch.set_num_threads(max(1, int(cpus)))  # as scheduled: replicas must not fight over the node's cores
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        local = local_model_dir(uri)
        self.model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval().to(self.device)
        self.tok = AutoTokenizer.from_pretrained(local)
        c = self.model.config
        self.context = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None) or 2048
        meta_path = os.path.join(local, EXPORT_META)
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        self.info_ = {"id": version, "version": version, "params": param_count(self.model), "step": meta.get("step"),
                      "source": uri, "source_checkpoint": meta.get("source_checkpoint"), "context": self.context,
                      "device": self.device, "lineage": model_id(local)}  # its lineage.json's id (`raytrain lineage`)
        self.version, self.chat_template = version, chat_template
        self.served = 0
        self.token_text: dict[int, str] = {}
        self.handle_batch.set_max_batch_size(max_batch_size)
        self.handle_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    def info(self) -> dict:
        return {**self.info_, "served_requests": self.served}

    async def __call__(self, req: dict) -> dict:
        return await self.handle_batch(req)

    async def stream(self, req: dict):
        """One request's events as they happen, batched with every other request like `__call__`:
        {"start": {prompt_pieces, prompt_tokens}} once it is validated, {"pieces": [...]} as its tokens are
        generated (none while log-probabilities are asked for: they come from the scoring pass after
        generation), then {"result": ...} (an error result alone when the request was refused). Yields lists
        of them: whatever is ready at once goes in one message (each message costs more than a token)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        # The batch runs in a worker thread: its events reach this loop in the order they were sent, and
        # all of them before the batch's own result.
        sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)  # noqa: E731
        done = asyncio.ensure_future(self.handle_batch({**req, "sink": sink}))
        while not done.done():
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                break
            ready = [get.result()]
            while not events.empty():
                ready.append(events.get_nowait())
            yield ready
        ready = []
        while not events.empty():
            ready.append(events.get_nowait())
        yield ready + [{"result": done.result()}]

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def handle_batch(self, reqs: list[dict]) -> list[dict]:
        # The forward passes run off the event loop so the next batch can queue meanwhile.
        return await asyncio.to_thread(self._run, reqs)

    def _run(self, reqs: list[dict]) -> list[dict]:
        import torch

        out = [self._prepare(r) for r in reqs]
        ok = [i for i, o in enumerate(out) if "error" not in o]
        for i in ok:
            if reqs[i].get("sink"):
                reqs[i]["sink"]({"start": {"prompt_pieces": out[i].get("prompt_pieces"),
                                           "prompt_tokens": len(out[i]["ids"])}})
        with torch.no_grad():
            greedy: dict[int, list[int]] = {}
            for i in ok:
                new = int(reqs[i].get("max_new_tokens", DEFAULT_NEW_TOKENS))
                if new and float(reqs[i].get("temperature", 0.0)) == 0:
                    greedy.setdefault(new, []).append(i)
                else:
                    out[i].update(self._generate(out[i]["ids"], reqs[i]))
            for new, group in greedy.items():
                gens = self._greedy([out[i]["ids"] for i in group], new,
                                    streaming.streamer([self._feed(reqs[i]) for i in group]))
                for i, g in zip(group, gens):
                    out[i].update(streaming.finish(self.tok, g, reqs[i].get("stop") or []))
            # One padded forward for every request that wants log-probabilities: the echoed prompt and the
            # generated tokens are scored together, batched across requests.
            scored = [i for i in ok if reqs[i].get("logprobs") or reqs[i].get("top_logprobs") is not None]
            if scored:
                self._score([reqs[i] for i in scored], [out[i] for i in scored])
        for o in out:
            o["version"] = self.version
            if "error" not in o:
                ids = o.pop("ids")
                o.update(status=200, prompt_tokens=len(ids), cold=self.served == 0)
                self.served += 1
        return out

    def _prepare(self, r: dict) -> dict:
        """The prompt's token ids (text, ids, or chat messages through the template), or the error to answer."""
        from raytrain.serving.fields import RequestError
        from raytrain.serving.openai_api import DEFAULT_CHAT_TEMPLATE, render_chat

        try:
            if "messages" in r:
                fallback = None if self.chat_template == "none" else DEFAULT_CHAT_TEMPLATE
                ids = self.tok(render_chat(self.tok, r["messages"], fallback=fallback))["input_ids"]
            else:
                ids = list(r["ids"]) if "ids" in r else self.tok(r["text"])["input_ids"]
        except RequestError as e:
            return {"status": e.status, "error": e.reason, "param": e.param}
        n, new = len(ids), int(r.get("max_new_tokens", DEFAULT_NEW_TOKENS))
        vocab = self.model.config.vocab_size
        if n == 0:
            return {"status": 422, "error": "the text has no tokens; send some text"}
        if any(not 0 <= t < vocab for t in ids):
            return {"status": 422, "error": f"a token id is outside the vocabulary [0, {vocab}); send ids this "
                    "model's tokenizer made", "param": "prompt"}
        if n + new > self.context:
            return {"status": 413, "error": f"input of {n} tokens + {new} new tokens exceeds the model's "
                    f"context of {self.context} tokens; shorten the text or ask for fewer tokens"}
        out = {"ids": ids}
        if r.get("echo"):
            out["prompt_pieces"] = self._pieces(ids)
        return out

    def _pieces(self, ids: list[int]) -> list[str]:
        return streaming.pieces(self.tok, ids)

    def _feed(self, req: dict) -> Optional[streaming.RowFeed]:
        """Where a streamed request's tokens go as they are generated (None: not streamed token by token)."""
        if not req.get("sink") or req.get("top_logprobs") is not None:
            return None
        return streaming.RowFeed(self.tok, eot=self.tok.eos_token_id, stops=req.get("stop") or [], sink=req["sink"])

    def _token_text(self, i: int) -> str:
        if i not in self.token_text:
            self.token_text[i] = self.tok.decode([i])
        return self.token_text[i]

    def _score(self, reqs: list[dict], outs: list[dict]) -> None:
        """log p(token_i | tokens_<i) for i >= 1 of prompt + continuation, one padded forward for the batch
        (right padding: causal attention keeps the padding out of every real position); with `top_logprobs`
        k, the k likeliest tokens at each position too (plus the chosen one, as OpenAI answers)."""
        import torch

        seqs = [o["ids"] + (o.get("gen_ids", []) if r.get("top_logprobs") is not None else []) for r, o in zip(reqs, outs)]
        longest = max(len(s) for s in seqs)
        x = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros_like(x)
        for j, s in enumerate(seqs):
            x[j, :len(s)] = torch.tensor(s)
            mask[j, :len(s)] = 1
        logits = self.model(input_ids=x.to(self.device), attention_mask=mask.to(self.device)).logits.float()
        full = torch.log_softmax(logits[:, :-1], dim=-1)
        lp = full.gather(-1, x[:, 1:, None].to(self.device))[..., 0].cpu()
        k = max([r.get("top_logprobs") or 0 for r in reqs])
        top = full.topk(k, dim=-1) if k else None
        for j, (r, o, s) in enumerate(zip(reqs, outs, seqs)):
            lps, n = lp[j, :len(s) - 1].tolist(), len(o["ids"])
            if r.get("logprobs"):  # /predict
                o["logprobs"], o["tokens"] = lps[:n - 1], self.tok.convert_ids_to_tokens(o["ids"])
            kj = r.get("top_logprobs")
            if kj is None:
                continue
            tops = []
            for pos in range(len(s) - 1):
                d = {self._token_text(s[pos + 1]): lps[pos]}
                if kj:
                    vals, idx = top.values[j, pos, :kj].tolist(), top.indices[j, pos, :kj].tolist()
                    d.update({self._token_text(t): v for t, v in zip(idx, vals)})
                tops.append(d)
            o["prompt_lp"], o["prompt_top"] = lps[:n - 1], tops[:n - 1]
            o["gen_lp"], o["gen_top"] = lps[n - 1:], tops[n - 1:]

    def _greedy(self, seqs: list[list[int]], new: int, streamer=None) -> list[list[int]]:
        """Greedy continuations of several prompts in one generate() call (left padding; transformers derives
        the positions from the attention mask)."""
        import torch

        longest = max(len(s) for s in seqs)
        eot = self.tok.eos_token_id
        x = torch.full((len(seqs), longest), eot, dtype=torch.long)
        mask = torch.zeros_like(x)
        for j, s in enumerate(seqs):
            x[j, longest - len(s):] = torch.tensor(s)
            mask[j, longest - len(s):] = 1
        gen = self.model.generate(input_ids=x.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                  max_new_tokens=new, pad_token_id=eot, eos_token_id=eot,
                                  streamer=streamer)[:, longest:].tolist()
        return gen

    def _generate(self, ids: list[int], req: dict) -> dict:
        import torch
        from transformers import set_seed

        new = int(req.get("max_new_tokens", DEFAULT_NEW_TOKENS))
        if new == 0:
            return streaming.finish(self.tok, [], [])
        temperature = float(req.get("temperature", 0.0))
        # Per request, not per batch: a seeded request answers the same whatever it was batched with.
        if req.get("seed") is not None:
            set_seed(int(req["seed"]))
        eot = self.tok.eos_token_id
        top_p = float(req.get("top_p", 1.0))
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0
                    else {"do_sample": False})
        x = torch.tensor([ids], device=self.device)
        gen = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                  pad_token_id=eot, eos_token_id=eot, streamer=streaming.streamer([self._feed(req)]),
                                  **sampling)[0, len(ids):].tolist()
        return streaming.finish(self.tok, gen, req.get("stop") or [])


# --- ingress ------------------------------------------------------------------------------------------


def _prompt_text(path: str, body: dict) -> Optional[str]:
    """The request's prompt as the audit digests it: /predict's text, /v1/completions' prompt, chat's messages
    (non-strings as JSON); None when the body has none."""
    key = "text" if path == "/predict" else "messages" if path == "/v1/chat/completions" else "prompt"
    v = body.get(key)
    return v if isinstance(v, str) or v is None else json.dumps(v, ensure_ascii=False)


def _joined(texts: list[str]) -> str:
    """One completion as it is; several (n, a list of prompts) as a JSON list, in choice order."""
    return texts[0] if len(texts) == 1 else json.dumps(texts, ensure_ascii=False)


def _metrics():
    from ray.util.metrics import Counter, Histogram

    return {
        "requests": Counter("model_requests_total", "HTTP requests answered, by status code, version and endpoint",
                            tag_keys=("status", "version", "endpoint")),
        "latency": Histogram("model_request_latency_ms", "request latency at the router (ms)",
                             boundaries=LATENCY_BOUNDARIES_MS, tag_keys=("version", "endpoint")),
        "tokens": Counter("model_generated_tokens_total", "tokens generated (rate: tokens/s)", tag_keys=("version",)),
    }


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
class Router:
    def __init__(self, stable, stable_version: str, canary=None, canary_version: Optional[str] = None,
                 canary_fraction: float = 0.0, audit: Optional[dict] = None):
        self.handles = {stable_version: stable}
        if canary is not None:
            if canary_version == stable_version:
                raise ValueError(f"the canary's version name {canary_version!r} is the stable one's; name it apart")
            self.handles[canary_version] = canary
        self.stable, self.canary = stable_version, canary_version if canary is not None else None
        self.fraction = canary_fraction if self.canary else 0.0
        self.rng = random.Random()
        self.m = _metrics()
        self._audit_start(audit or {})

    # -- audit --
    def _audit_start(self, audit: dict) -> None:
        """audit: {uri, text, deployment, models: {version: model uri}}; no uri: no records. The router records for
        the whole deployment (every request passes it); a restarted router writes as a new writer, and its deploy
        record says the traffic is back to the deployed split."""
        self.audit = AuditWriter(audit["uri"]) if audit.get("uri") else None
        self.audit_text, self.deployment = bool(audit.get("text")), audit.get("deployment")
        if self.audit is not None:
            models = audit.get("models") or {}
            self.audit.record("deploy", flush_now=True, deployment=self.deployment, **self.traffic(),
                              models={v: models.get(v) for v in self._serving()}, audit_text=self.audit_text)

    def _audit_request(self, ctx: dict, status: int, latency_ms: float) -> None:
        """One generation request's record: no storage call here, the writer's thread writes it with others."""
        if self.audit is None:
            return
        keep = self.audit_text
        self.audit.record("request", deployment=self.deployment, endpoint=ctx["endpoint"],
                          version=None if ctx["version"] == "none" else ctx["version"], status=status,
                          latency_ms=round(latency_ms, 3), stream=bool(ctx.get("stream")),
                          prompt_tokens=ctx.get("prompt_tokens"), completion_tokens=ctx.get("completion_tokens"),
                          **text_fields("prompt", ctx.get("prompt"), keep),
                          **text_fields("completion", ctx.get("completion"), keep))

    def __del__(self):
        # Serve calls this at a graceful shutdown: the records still buffered are written before the replica goes.
        if getattr(self, "audit", None) is not None:
            self.audit.close()

    # -- traffic --
    def _serving(self) -> list[str]:
        return [self.stable] + ([self.canary] if self.canary else [])

    def _pick(self, asked: Optional[Any]) -> str:
        if asked is None or asked == APP_NAME:
            return self.canary if self.canary and self.rng.random() < self.fraction else self.stable
        if asked not in self._serving():
            raise RequestError(404, f"unknown version {asked!r}; serving: {', '.join(self._serving())}")
        return asked

    def traffic(self) -> dict:
        return {"stable": self.stable, "canary": self.canary, "canary_fraction": self.fraction}

    # -- HTTP --
    async def __call__(self, request: Request):
        t0 = time.perf_counter()
        path = request.url.path.rstrip("/") or "/"
        endpoint = path if path in ENDPOINTS else "other"
        # version: set once routed (a failure after that counts against the version that had it); the rest is
        # what the audit record of a generation request says.
        ctx = {"version": "none", "endpoint": endpoint, "t0": t0}
        try:
            status, body = await self._dispatch(request, path, ctx)
        except RequestError as e:
            status, body = e.status, self._error(path, e.status, e.reason, e.param)
        except Exception as e:  # noqa: BLE001 - e.g. a replica that died: counted, answered in one line
            status, body = 503, self._error(path, 503, f"the request failed in the server ({type(e).__name__}); retry")
        latency_ms = (time.perf_counter() - t0) * 1e3
        if endpoint in GENERATION and not (ctx.get("stream") and status == 200):  # a stream records at its end
            self._audit_request(ctx, status, latency_ms)
        self.m["requests"].inc(tags={"status": str(status), "version": ctx["version"], "endpoint": endpoint})
        if status == 200 and endpoint in ("/predict", "/v1/completions", "/v1/chat/completions"):
            self.m["latency"].observe(latency_ms, tags={"version": ctx["version"], "endpoint": endpoint})
        return body if isinstance(body, Response) else JSONResponse(body, status_code=status)

    @staticmethod
    def _error(path: str, status: int, reason: str, param: Optional[str] = None) -> dict:
        # OpenAI clients read {"error": {"message", ...}}; /predict and the admin calls keep their one-line error.
        return openai_api.error_body(status, reason, param) if path.startswith("/v1/") else {"error": reason}

    async def _dispatch(self, request: Request, path: str, ctx: dict) -> tuple[int, Any]:
        routes = {"/predict": "POST", "/v1/completions": "POST", "/v1/chat/completions": "POST", "/healthz": "GET",
                  "/v1/models": "GET", "/admin/traffic": "GET POST", "/admin/promote": "POST",
                  "/admin/rollback": "POST"}
        if path not in routes:
            raise RequestError(404, f"no endpoint {path}; try POST /predict, POST /v1/completions, POST "
                               f"/v1/chat/completions, GET /healthz, GET /v1/models")
        if request.method not in routes[path].split():
            raise RequestError(405, f"{path} takes {routes[path].replace(' ', ' or ')}, not {request.method}")
        if path == "/healthz":
            return 200, {"status": "ok", **self.traffic()}
        if path == "/v1/models":
            return 200, await self._models()
        if path.startswith("/admin/"):
            return self._admin(request, path, await self._json(request) if request.method == "POST" else {})
        body = await self._json(request)
        ctx["prompt"] = _prompt_text(path, body)
        if path == "/predict":
            text = body.get("text")
            if not isinstance(text, str) or not text:
                raise RequestError(422, "the body needs a non-empty string 'text', e.g. {\"text\": \"one two\"}")
            req = {"text": text, "logprobs": True,
                   "max_new_tokens": int_field(body, "max_new_tokens", DEFAULT_NEW_TOKENS, 0, 4096)}
            version = ctx["version"] = self._pick(body.get("version"))
            res = await self._call(version, req)
            ctx.update(completion=res["continuation"], prompt_tokens=res["prompt_tokens"],
                       completion_tokens=res["completion_tokens"])
            return 200, {k: res[k] for k in ("version", "continuation", "tokens", "logprobs", "prompt_tokens",
                                              "completion_tokens", "cold")}
        parsed = (openai_api.parse_chat if path == "/v1/chat/completions" else openai_api.parse_completion)(body)
        version = ctx["version"] = self._pick(body.get("model"))
        if parsed.stream:
            answer = await self._stream(version, parsed, ctx)
            ctx["stream"] = True
            return 200, answer
        # One replica request per prompt and choice: Serve batches them with each other and with other clients'.
        results = await asyncio.gather(*(self._call(version, r) for r in parsed.requests()))
        out = openai_api.response(parsed, results, version)
        ctx.update(completion=_joined([r["continuation"] for r in results]),
                   prompt_tokens=out["usage"]["prompt_tokens"], completion_tokens=out["usage"]["completion_tokens"])
        return 200, out

    async def _json(self, request: Request) -> dict:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise RequestError(415, f"send the body as JSON with Content-Type: application/json (got {ctype or 'none'!r})")
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the body is not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(body, dict):
            raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def _call(self, version: str, req: dict) -> dict:
        res = await self.handles[version].remote(req)
        if res.get("error"):
            raise RequestError(res["status"], res["error"], res.get("param"))
        if res["completion_tokens"]:
            self.m["tokens"].inc(res["completion_tokens"], tags={"version": version})
        return res

    async def _stream(self, version: str, parsed: openai_api.Parsed, ctx: dict) -> StreamingResponse:
        """One replica stream per prompt and choice (batched like any request). The answer starts once each
        choice is accepted, so a refused request is a 4xx rather than a broken stream; then chunks follow
        as the tokens are generated."""
        handle = self.handles[version].options(stream=True)
        gens = [handle.stream.remote(r) for r in parsed.requests()]
        try:
            firsts = await asyncio.gather(*(g.__anext__() for g in gens))
            for evs in firsts:
                res = evs[-1].get("result") or {}
                if res.get("error"):
                    raise RequestError(res["status"], res["error"], res.get("param"))
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        return StreamingResponse(self._events(version, parsed, gens, firsts, ctx), media_type="text/event-stream")

    async def _events(self, version: str, parsed: openai_api.Parsed, gens: list, firsts: list[dict], ctx: dict):
        """The choices' replica events merged in arrival order, as server-sent OpenAI chunks; the request's audit
        record once it ends (499: the client went away first)."""
        shape, arrived, status = openai_api.StreamShaper(parsed, version), asyncio.Queue(), 499

        async def pump(i: int, gen) -> None:
            try:
                async for evs in gen:
                    arrived.put_nowait((i, evs))
            except Exception as e:  # noqa: BLE001 - e.g. the replica died: the stream says so and ends
                arrived.put_nowait((i, [{"failed": type(e).__name__}]))

        for i, evs in enumerate(firsts):
            arrived.put_nowait((i, evs))
        pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(gens)
            while left:
                i, evs = await arrived.get()
                if "failed" in evs[-1]:
                    status = 503
                    yield openai_api.sse_event(openai_api.error_body(
                        503, f"the stream failed in the server ({evs[-1]['failed']}); retry"))
                    break
                if "result" in evs[-1]:
                    left -= 1
                    if evs[-1]["result"]["completion_tokens"]:
                        self.m["tokens"].inc(evs[-1]["result"]["completion_tokens"], tags={"version": version})
                # One write for whatever arrived together.
                text = "".join(openai_api.sse_event(chunk) for ev in evs for chunk in shape.event(i, ev))
                if text:
                    yield text
            tail = shape.close() if not left else []
            status = 200 if status == 499 else status
            yield "".join(openai_api.sse_event(chunk) for chunk in tail) + openai_api.SSE_DONE
        finally:  # also when the client goes away mid-stream
            for t in pumps:
                t.cancel()
            for g in gens:
                g.cancel()
            results = [shape.results[i] for i in sorted(shape.results)]
            ctx.update(completion=_joined([r["continuation"] for r in results]) if results else None,
                       prompt_tokens=sum(r["prompt_tokens"] for r in results[::parsed.n]) if results else None,
                       completion_tokens=sum(r["completion_tokens"] for r in results) if results else None)
            self._audit_request(ctx, status, (time.perf_counter() - ctx["t0"]) * 1e3)

    async def _models(self) -> dict:
        roles = {self.stable: "stable", **({self.canary: "canary"} if self.canary else {})}
        infos = await asyncio.gather(*(self.handles[v].info.remote() for v in self._serving()))
        return {"object": "list", "data": [
            {**i, "object": "model", "owned_by": "raytrain", "role": roles[i["version"]],
             "traffic": (1 - self.fraction) if i["version"] == self.stable else self.fraction} for i in infos]}

    def _admin(self, request: Request, path: str, body: dict) -> tuple[int, dict]:
        from raytrain.internals.ray import token_auth_enabled, valid_request_token
        from raytrain.ray_auth import local_token

        # Whoever may submit Ray jobs may move traffic: the same token. Without token authentication there is no
        # credential to check, and a peer's address is none: a TLS proxy, a sidecar or any local process is a
        # loopback peer. So admin calls are refused then, from every address (the audit record keeps the peer's
        # address as information only).
        if not token_auth_enabled():
            raise RequestError(403, "admin calls need a credential and Ray token authentication is off: restart "
                               "Ray and `raytrain serve` with RAY_AUTH_MODE=token, then send the Ray token "
                               "(`raytrain serve promote|rollback|split` sends it)")
        if not valid_request_token(request.headers.get("authorization", ""), local_token()):
            raise RequestError(401, "traffic changes need the Ray auth token: Authorization: Bearer <token> "
                               "(`raytrain serve promote|rollback|split` sends it)")
        if request.method != "POST":
            return 200, self.traffic()
        before, version = self.traffic(), self.canary
        if path == "/admin/traffic":
            f = body.get("canary_fraction")
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
                raise RequestError(422, f"'canary_fraction' must be a number in [0, 1], got {f!r}")
            if not self.canary:
                raise RequestError(409, "no canary is deployed; start one with `raytrain serve MODEL --canary MODEL2`")
            self.fraction = float(f)
        elif path == "/admin/promote":
            if not self.canary:
                raise RequestError(409, "no canary to promote")
            self.stable, self.canary, self.fraction = self.canary, None, 0.0
        elif path == "/admin/rollback":
            if not self.canary:
                raise RequestError(409, "no canary to roll back")
            self.canary, self.fraction = None, 0.0
        if self.audit is not None:  # written at once (flush_now): traffic changes are rare and must not wait
            self.audit.record(ADMIN_EVENTS[path], flush_now=True, deployment=self.deployment, version=version,
                              before=before, after=self.traffic(), client=getattr(request.client, "host", None))
        return 200, self.traffic()


def build(stable_uri: str, stable_version: str, *, canary_uri: Optional[str] = None,
          canary_version: Optional[str] = None, canary_fraction: float = 0.0, replicas: int = 1, max_replicas: Optional[int] = None, num_cpus: float = 1,
          num_gpus: float = 0, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.005,
          chat_template: str = "default", audit_uri: Optional[str] = None, audit_text: bool = False):
    """The Serve application: a router and one model deployment per version; the router's audit records go under
    `audit_uri` (none without one), prompt and completion text only with `audit_text`."""
    scale = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                     "target_ongoing_requests": max_batch_size}}
             if max_replicas and max_replicas > replicas else {"num_replicas": replicas})
    opts = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus}, **scale}
    stable = ModelServer.options(name="model", **opts).bind(stable_uri, stable_version, max_batch_size,
                                                            batch_wait_timeout_s, chat_template=chat_template)
    canary = None
    if canary_uri:
        canary = ModelServer.options(name="canary", **opts).bind(canary_uri, canary_version, max_batch_size,
                                                                 batch_wait_timeout_s, chat_template=chat_template)
    # One id per deployment, kept by a restarted router: a reader groups a deployment's records by it.
    deployment = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(4).hex()}"
    audit = {"uri": audit_uri, "text": audit_text, "deployment": deployment,
             "models": {stable_version: stable_uri, **({canary_version: canary_uri} if canary_uri else {})}}
    return Router.bind(stable, stable_version, canary, canary_version, canary_fraction, audit=audit)


def app_builder(args: dict):
    """For Serve config files (`serve deploy`, cluster/serve.yaml): `import_path: raytrain.serving.app:app_builder`.

    args: model (exported dir, run or RUN@TAG), version, canary, canary_version, canary_fraction, replicas,
    max_replicas, num_cpus, num_gpus (default: 1 when the cluster has GPUs), max_batch_size, batch_wait_timeout_s,
    chat_template ("default": raytrain's template for models without one; "none": chat answers 400 for them),
    audit (where the audit records go; default `<model dir>.audit`, "none": no records), audit_text (also keep
    prompt and completion text; default false).
    """
    import ray

    from raytrain.audit import serve_root
    from raytrain.serving.source import resolve

    known = {"model", "version", "canary", "canary_version", "canary_fraction", "replicas", "max_replicas",
             "num_cpus", "num_gpus", "max_batch_size", "batch_wait_timeout_s", "chat_template", "audit", "audit_text"}
    unknown = set(args) - known
    if unknown or "model" not in args:
        raise ValueError(f"raytrain serve args: unknown {sorted(unknown)}, required 'model'; known: {sorted(known)}")
    stable = resolve(args["model"], args.get("version"))
    canary = resolve(args["canary"], args.get("canary_version")) if args.get("canary") else None
    gpus = args.get("num_gpus")
    if gpus is None:
        gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return build(stable.uri, stable.version, canary_uri=canary.uri if canary else None,
                 canary_version=canary.version if canary else None,
                 canary_fraction=float(args.get("canary_fraction", 0.0)), replicas=int(args.get("replicas", 1)),
                 max_replicas=args.get("max_replicas"), num_cpus=float(args.get("num_cpus", 1)), num_gpus=float(gpus),
                 max_batch_size=int(args.get("max_batch_size", 8)),
                 batch_wait_timeout_s=float(args.get("batch_wait_timeout_s", 0.005)),
                 chat_template=str(args.get("chat_template", "default")),
                 audit_uri=None if args.get("audit") == "none" else args.get("audit") or serve_root(stable.uri),
                 audit_text=bool(args.get("audit_text", False)))
