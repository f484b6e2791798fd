"""Audit records (raytrain/audit.py): segments written once by each writer, none lost under concurrency, torn ones
read tolerantly; a run's submissions; a deployment's deploy / promote / rollback and per-request records, without
the text unless asked (the router itself, with stand-in model handles; and one real Ray Serve deployment)."""

import asyncio
import json
import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from raytrain import audit, storage
from raytrain.audit import AuditWriter, read, run_event, run_root

PROMPT = "the secret prompt sentence"


def _check_per_writer_order(recs: list[dict], expect: dict[str, int]) -> None:
    """Per writer: records 0..n-1 of each source, each once, in the order it recorded them."""
    by: dict[str, list[int]] = {}
    for r in recs:
        by.setdefault(r["src"], []).append(r["i"])
    assert {k: len(v) for k, v in by.items()} == expect
    for src, seen in by.items():
        assert seen == list(range(expect[src])), src


def _write_in_process(root: str, src: str, n: int) -> str:
    w = AuditWriter(root, every=9, seconds=0.02)
    for i in range(n):
        w.record("event", src=src, i=i)
    assert w.close()
    return w.id


def test_concurrent_writers_lose_no_record_and_keep_each_writers_order(tmp_path):
    root = str(tmp_path / "audit")
    threads, n = 8, 300
    seen_prefixes, stop = [], threading.Event()

    def reader():  # reads while the writers write: whatever it sees is whole segments, each writer's a prefix
        while not stop.is_set():
            by: dict[str, list[int]] = {}
            for r in read(root):
                by.setdefault(r["src"], []).append(r["i"])
            seen_prefixes.append(all(v == list(range(len(v))) for v in by.values()))

    def writer(k):
        w = AuditWriter(root, every=7, seconds=0.01)
        for i in range(n):
            w.record("event", src=f"t{k}", i=i)
            if i % 50 == 0:
                time.sleep(0.001)
        assert w.close()

    ctx = multiprocessing.get_context("spawn")  # other processes too, each its own writer
    with ctx.Pool(2) as pool:
        procs = pool.starmap_async(_write_in_process, [(root, f"p{k}", 200) for k in range(2)])
        r = threading.Thread(target=reader)
        r.start()
        ws = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
        for t in ws:
            t.start()
        for t in ws:
            t.join()
        ids = procs.get(timeout=120)
        stop.set()
        r.join()
    recs = read(root)
    _check_per_writer_order(recs, {**{f"t{k}": n for k in range(threads)}, "p0": 200, "p1": 200})
    assert len({r["writer"] for r in recs}) == threads + 2 and set(ids) <= {r["writer"] for r in recs}
    assert [(r["time"], r["writer"], r["segment"]) for r in recs] == sorted(
        (r["time"], r["writer"], r["segment"]) for r in recs)
    assert seen_prefixes and all(seen_prefixes)
    # Batched: segments of many records each (what waited when the writer's thread woke), numbered in order from 0,
    # nothing else left behind (no temp file); each writer's first and last segment anchored.
    for d in Path(root).iterdir():
        if d.name == audit.ANCHORS:
            continue
        names = sorted(p.name for p in d.iterdir())
        assert names == [audit.segment_name(i) for i in range(len(names))], names
        assert sorted(p.name for p in (Path(root) / audit.ANCHORS / d.name).iterdir()) == [
            "first.json", f"last-{len(names) - 1:08d}.json"]
    assert audit.verify(root).ok
    assert len(list(Path(root).rglob("*.jsonl"))) < len(recs) / 2


def test_a_torn_segment_is_read_without_its_torn_line_and_a_temp_file_is_not_a_segment(tmp_path):
    root = tmp_path / "audit"
    w = AuditWriter(str(root))
    w.record("deploy", version="v1")
    assert w.close()
    torn = root / "host-1-deadbeef"
    torn.mkdir()
    whole = [{"time": 1.0, "kind": "request", "n": 1}, {"time": 2.0, "kind": "request", "n": 2}]
    (torn / "00000000.jsonl").write_bytes(
        b"".join(json.dumps(r).encode() + b"\n" for r in whole) + b'{"time": 3.0, "kind": "requ\xe2\x82')
    (torn / "00000001.jsonl.tmp-99").write_text(json.dumps({"time": 4.0, "kind": "half"}) + "\n")
    recs = read(str(root))
    assert [(r["kind"], r.get("n")) for r in recs] == [("request", 1), ("request", 2), ("deploy", None)]
    assert read(str(tmp_path / "nothing-here")) == []


def test_a_refused_write_keeps_the_records_and_retries_the_same_segment(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "audit")
    w = AuditWriter(root, every=1000, seconds=3600)
    real, calls = storage.write_once, []

    def flaky(uri, data):
        calls.append((uri, data))
        if len(calls) == 1:
            raise OSError("503 Slow Down")
        return real(uri, data)

    monkeypatch.setattr(storage, "write_once", flaky)
    w.record("a", i=0)
    assert not w.flush()
    assert "cannot write a segment" in capsys.readouterr().err and read(root) == []
    w.record("b", i=1)
    assert w.close()
    assert calls[0] == calls[1]  # the same segment, the same bytes: retried, never rewritten with other content
    assert [(r["kind"], r["segment"]) for r in read(root)] == [("a", 0), ("b", 1)]


def test_run_events_and_the_submit_record(tmp_path):
    from raytrain.config import load_config
    from raytrain.trainer import audit_submit

    run_uri = str(tmp_path / "run")
    overrides = [f"checkpoint.storage={tmp_path}", "run.name=run", "optim.lr=3e-4"]
    cfg = load_config("tiny", overrides)
    rec = audit_submit(cfg, {"recipe": "tiny", "overrides": overrides})
    run_event(run_uri, "resume", step=10, world_size=2)
    run_event(run_uri, "rollback", from_step=14, to_step=10, reason="loss spike")
    recs = read(run_root(run_uri))
    assert [r["kind"] for r in recs] == ["submit", "resume", "rollback"]
    import hashlib

    assert recs[0]["config_sha256"] == hashlib.sha256(cfg.to_yaml().encode()).hexdigest() == rec["config_sha256"]
    assert recs[0]["overrides"] == overrides and recs[0]["config"]["optim"]["lr"] == 3e-4
    assert len({r["segment"] for r in recs}) == 3 and len({r["writer"] for r in recs}) == 1  # each written at once
    assert storage.join(run_uri, "audit") == run_root(run_uri)


def test_segments_on_s3(s3_server):
    root = "s3://raytrain-test/audit-test/audit"
    ws = [AuditWriter(root, every=3, seconds=60) for _ in range(2)]
    for i in range(7):
        for k, w in enumerate(ws):
            w.record("event", src=f"w{k}", i=i)
    assert all(w.close() for w in ws)
    _check_per_writer_order(read(root), {"w0": 7, "w1": 7})


# --- serving: the router with stand-in model handles (no Ray) -----------------------------------------------


class _Handle:
    """A model deployment's handle as the router uses it: `.remote(req)` awaits a replica result;
    `.options(stream=True).stream.remote(req)` streams its events."""

    def __init__(self, version: str, streams: bool = False):
        self.version, self.streams = version, streams
        self.stream = self

    def result(self) -> dict:
        return {"version": self.version, "continuation": f" answer of {self.version}", "tokens": ["a"],
                "logprobs": [], "prompt_tokens": 4, "completion_tokens": 3, "cold": False, "status": 200,
                "finish_reason": "length", "gen_pieces": [" answer", " of", f" {self.version}"]}

    def remote(self, req: dict):
        if self.streams:
            return _Events(self.result())

        async def answer():
            await asyncio.sleep(0.001 * (hash(req.get("text", "")) % 5))
            return self.result()
        return answer()

    def options(self, stream: bool = False):
        return _Handle(self.version, streams=stream)


class _Events:
    """A replica stream: start, the pieces as generated, the result."""

    def __init__(self, result: dict):
        evs = [[{"start": {"prompt_pieces": None, "prompt_tokens": 4}}], [{"pieces": result["gen_pieces"]}],
               [{"result": result}]]
        self.it = iter(evs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self.it)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        pass


def _request(method: str, path: str, body: dict | None = None, token: str | None = None):
    from starlette.requests import Request

    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"),
               *([(b"authorization", f"Bearer {token}".encode())] if token is not None else [])]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000), "scheme": "http", "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def _router(root: str, text: bool = False):
    from raytrain.serving.app import Router

    cls = Router.func_or_class  # the class itself, outside Serve
    return cls(_Handle("v1"), "v1", _Handle("v2"), "v2", 0.5,
               audit={"uri": root, "text": text, "deployment": "dep-1", "models": {"v1": "/m/v1", "v2": "/m/v2"}})


N_LOAD = 120


def _body(i: int) -> tuple[str, dict, str]:
    """Request i: (path, body, the prompt text its audit record digests)."""
    if i % 3 == 0:
        return "/predict", {"text": f"{PROMPT} {i}"}, f"{PROMPT} {i}"
    if i % 3 == 1:
        return "/v1/completions", {"prompt": f"{PROMPT} {i}", "max_tokens": 3}, f"{PROMPT} {i}"
    msgs = [{"role": "user", "content": f"{PROMPT} {i}"}]
    return "/v1/chat/completions", {"messages": msgs}, json.dumps(msgs)


# The prompt digests of the requests sent after the traffic change.
_LATER = {audit.text_fields("p", _body(i)[2])["p_sha256"] for i in range(N_LOAD // 2, N_LOAD)}


async def _load_with(router, action: str, n: int = N_LOAD) -> list[int]:
    """n concurrent generation requests (predict, completions, chat), `action` (promote / rollback) mid-way."""
    async def one(i):
        path, body, _ = _body(i)
        return (await router(_request("POST", path, body))).status_code

    first = [asyncio.ensure_future(one(i)) for i in range(n // 2)]
    await asyncio.sleep(0)
    admin = await router(_request("POST", f"/admin/{action}", {}, token=TOKEN))
    assert admin.status_code == 200, admin.body
    rest = [asyncio.ensure_future(one(i)) for i in range(n // 2, n)]
    bad = await router(_request("POST", "/predict", {"txt": PROMPT}))  # refused (422): still one record
    return [*(await asyncio.gather(*first, *rest)), bad.status_code]


TOKEN = "test-token-0123456789"


def _token_auth(monkeypatch, on: bool) -> None:
    """The router's admin check as on a cluster with Ray token authentication `on` and this machine's token TOKEN.
    On: Ray's own check is not asked (it reads the token Ray loaded, not this test's): the fallback that compares
    with this machine's token, which is what Ray's check does."""
    import raytrain.internals.ray as internals

    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    monkeypatch.setattr(internals, "token_auth_enabled", lambda: on)
    real_gate = internals.gate
    monkeypatch.setattr(internals, "gate", lambda name: name != internals.AUTH_CHECK and real_gate(name))


def test_router_records_deploy_promote_rollback_and_every_request_without_text(tmp_path, monkeypatch):
    _token_auth(monkeypatch, on=True)  # admin calls carry the token
    root = str(tmp_path / "model.audit")
    promoted, rolled_back = _router(root), _router(root)  # two deployments, one audit root, a writer each
    statuses = asyncio.run(_load_with(promoted, "promote")) + asyncio.run(_load_with(rolled_back, "rollback"))
    assert statuses.count(200) == 240 and statuses.count(422) == 2
    promoted.__del__()  # what Serve calls at a graceful shutdown
    rolled_back.__del__()
    verdict = audit.verify(root)  # both routers' chains whole, each closed: its last segment anchored
    assert verdict.ok and "2 writers" in verdict.summary and "not closed" not in verdict.summary, verdict
    recs = read(root)
    requests = [r for r in recs if r["kind"] == "request"]
    assert len(requests) == len(statuses) and sorted(r["status"] for r in requests) == sorted(statuses)
    assert [r["kind"] for r in recs if r["kind"] != "request"].count("deploy") == 2
    promote = next(r for r in recs if r["kind"] == "promote")
    assert (promote["version"], promote["before"]["stable"], promote["after"]) == (
        "v2", "v1", {"stable": "v2", "canary": None, "canary_fraction": 0.0})
    rollback = next(r for r in recs if r["kind"] == "rollback")
    assert rollback["version"] == "v2" and rollback["after"]["stable"] == "v1"
    deploy = next(r for r in recs if r["kind"] == "deploy")
    assert deploy["models"] == {"v1": "/m/v1", "v2": "/m/v2"} and deploy["deployment"] == "dep-1"
    ok = [r for r in requests if r["status"] == 200]
    assert all(r["prompt_sha256"] and r["prompt_chars"] >= len(PROMPT) and r["completion_sha256"]
               and r["version"] in ("v1", "v2") and r["latency_ms"] >= 0 for r in ok)
    assert {r["endpoint"] for r in ok} == {"/predict", "/v1/completions", "/v1/chat/completions"}
    # Requests sent after the promotion went to v2 only, after the rollback to v1 only (each router's records).
    for action, version in (("promote", "v2"), ("rollback", "v1")):
        writer = next(r["writer"] for r in recs if r["kind"] == action)
        after = {r["version"] for r in ok if r["writer"] == writer and r["prompt_sha256"] in _LATER}
        assert after == {version}, (action, after)
    text = "".join(p.read_text() for p in Path(root).rglob("*.jsonl"))
    assert PROMPT not in text and "answer of" not in text  # digests and lengths only


def test_admin_calls_without_a_credential_are_refused_from_loopback_too(tmp_path, monkeypatch):
    """A peer's address is no credential (a TLS proxy on the serving host is a loopback peer): with token
    authentication off every admin call is refused, from 127.0.0.1 too, token or not; with it on, one without the
    token or with a wrong one is refused. Nothing changes and no admin record is written."""
    root = str(tmp_path / "model.audit")
    router = _router(root)
    before = router.traffic()

    async def call(method: str, path: str, token: str | None):
        r = await router(_request(method, path, {} if method == "POST" else None, token=token))
        return r.status_code, json.loads(r.body)["error"]

    _token_auth(monkeypatch, on=False)
    for method, path in (("POST", "/admin/promote"), ("POST", "/admin/rollback"), ("GET", "/admin/traffic")):
        for token in (None, TOKEN):
            status, error = asyncio.run(call(method, path, token))
            assert status == 403 and "RAY_AUTH_MODE=token" in error and "\n" not in error, (path, token, error)
    _token_auth(monkeypatch, on=True)
    for token in (None, "wrong"):
        status, error = asyncio.run(call("POST", "/admin/promote", token))
        assert status == 401 and "Ray auth token" in error, (token, error)
    assert router.traffic() == before
    router.__del__()
    assert not [r for r in read(root) if r["kind"] in ("traffic", "promote", "rollback")]


def test_router_keeps_the_text_only_when_asked(tmp_path, monkeypatch):
    import hashlib

    root = str(tmp_path / "model.audit")
    router = _router(root, text=True)

    async def go():
        plain = await router(_request("POST", "/predict", {"text": PROMPT}))
        streamed = await router(_request("POST", "/v1/completions", {"prompt": PROMPT, "stream": True}))
        chunks = [c async for c in streamed.body_iterator]  # the stream's record is written once it ends
        return plain.status_code, streamed.status_code, "".join(chunks)

    plain, streamed, chunks = asyncio.run(go())
    assert (plain, streamed) == (200, 200) and chunks.endswith("data: [DONE]\n\n")
    router.__del__()
    req, stream = [r for r in read(root) if r["kind"] == "request"]
    assert req["prompt"] == PROMPT and req["prompt_sha256"] == hashlib.sha256(PROMPT.encode()).hexdigest()
    assert req["completion"].startswith(" answer of") and req["completion_chars"] == len(req["completion"])
    assert (stream["stream"], stream["status"], stream["prompt"], stream["completion_tokens"]) == (True, 200, PROMPT, 3)
    assert stream["completion"] == f" answer of {stream['version']}" and stream["endpoint"] == "/v1/completions"
    assert audit.text_fields("x", "ab") == {"x_sha256": hashlib.sha256(b"ab").hexdigest(), "x_chars": 2}


# --- serving: a real Ray Serve deployment on the session's Ray cluster ---------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random 1-layer GPT-2 and a word-level tokenizer: what serving loads, with no training."""
    from raytrain.quiet import quiet_progress_bars

    quiet_progress_bars()
    d = tmp_path_factory.mktemp("model")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["<eot>", "<unk>", *PROMPT.split(), *"one two three four five six".split()]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eot>", unk_token="<unk>").save_pretrained(d)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                               eos_token_id=0, bos_token_id=0)).save_pretrained(d)
    return str(d)


@pytest.mark.slow
def test_a_served_deployment_records_every_request_under_a_rollback(ray_cluster, tiny_model, tmp_path):
    """Ray Serve on the session's cluster: concurrent requests while the canary is rolled back; once the application
    is deleted (the router's graceful shutdown writes what it holds) every request has its record."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from raytrain.serving.app import build
    from raytrain.serving.run import traffic
    from tests.helpers import free_port
    from tests.test_serve import _post

    model, root, port = tiny_model, str(tmp_path / "model.audit"), free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build(model, "v1", canary_uri=model, canary_version="v2", canary_fraction=0.5, num_cpus=0.5,
                        audit_uri=root), name="audit-test", route_prefix="/")
        n, done = 60, []

        def one(i):
            done.append(_post(url, "/predict", {"text": f"{PROMPT} {i}", "max_new_tokens": 2})[0])

        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            while len(done) < n // 3:
                time.sleep(0.02)
            assert traffic(url, "rollback")["canary"] is None  # while requests are in flight
            for f in futures:
                f.result()
        assert done.count(200) == n
    finally:
        serve.delete("audit-test")
        serve.shutdown()
    recs = read(root)
    kinds = [r["kind"] for r in recs]
    assert kinds.count("request") == n and kinds.count("deploy") == 1 and kinds.count("rollback") == 1
    assert {r["version"] for r in recs if r["kind"] == "request"} == {"v1", "v2"}
    assert PROMPT not in "".join(p.read_text() for p in Path(root).rglob("*.jsonl"))


def test_serve_with_an_unwritable_audit_uri_is_one_line(tiny_model, capsys):
    from raytrain.cli import main

    capsys.readouterr()
    assert main(["serve", tiny_model, "--audit", "/proc/raytrain-audit"]) == 2
    err = capsys.readouterr().err
    assert "cannot write audit records to /proc/raytrain-audit" in err and "--audit none" in err
    assert err.count("\n") == 1
