"""`raytrain serve` on a real Ray Serve application on 127.0.0.1, and `raytrain check --url` against it.

Two tiny runs are trained for the module: a pre-training run (checkpoints at steps 5 and 10, step 5 tagged v1.0)
and a LoRA fine-tune on chat examples (the fine-tuned result a user serves). One `raytrain serve RUN@v1.0 --canary
FINE_TUNE --canary-fraction 0.5` subprocess (its own local Ray, both exported on the fly, the adapter merged)
serves every test, which is why the order of the tests matters: the canary is rolled back, and the server
interrupted, at the end.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from raytrain.ckpt import catalog
from raytrain.cli import main
from raytrain.trainer import train
from tests.helpers import free_port, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent
STABLE, CANARY = "v1.0", "step-10"


def _post(url: str, path: str, body, ctype: str = "application/json", timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


WORDS = "one two three four five six seven eight nine ten".split()


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_data, tmp_path_factory):
    """(pre-training run URI, its summary, the fine-tune's run URI, its summary)."""
    from raytrain.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("serve")
    cfg = tiny_cfg(tiny_data, root, "served", "scaling.num_workers=1")  # one rank: the cheapest real checkpoints
    summary = train(cfg, log=lambda *_: None)
    catalog.tag(cfg.run_uri, STABLE, step=5)
    # The canary fine-tunes the stable model as a user would: its export, its tokenizer (so both versions read a
    # text as the same tokens, within the same context), on chat examples (the user counts from a word, the
    # assistant goes on) rendered with raytrain's default template, the one serving renders chat requests with.
    # LoRA on 1 rank, 10 steps.
    from raytrain.export import export

    base = root / "base"
    export(catalog.latest_complete(cfg.run_uri).uri, str(base), log=lambda *_: None)
    # Each record distinct (prepare drops exact duplicates, and val needs some) and short: the base's 300-token
    # vocabulary spends ~24 of its 32 positions on one.
    chats = [{"messages": [{"role": "user", "content": f"{WORDS[i % 7]} {i}"},
                           {"role": "assistant", "content": " ".join(WORDS[i % 7 + 1:i % 7 + 4])}]} for i in range(300)]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    prepare(PrepareConfig(inputs=[str(root / "chats.jsonl")], out=str(root / "chat"), format="chat",
                          tokenizer=str(base), seq_len=32, val_fraction=0.1, near_dup_threshold=1.0, engine="local"),
            log=lambda *_: None)
    ft = tiny_cfg(root / "chat", root, "fine-tuned", "scaling.num_workers=1", f"model.init_from={base}",
                  "model.lora.r=4", "model.lora.target_modules=[c_attn,c_fc]", "optim.lr=3e-2")
    return cfg.run_uri, summary, ft.run_uri, train(ft, log=lambda *_: None)


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    run_uri, summary, ft_uri, ft_summary = run
    d = tmp_path_factory.mktemp("server")
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_metrics_report_interval_ms="1000")
    log = (d / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "raytrain", "serve", f"{run_uri}@{STABLE}", "--canary", ft_uri,
                             "--canary-fraction", "0.5", "--port", str(port), "--metrics-port", str(metrics_port),
                             "--ready-file", str(d / "ready.json")], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=str(d))
    deadline = time.time() + 420
    while not (d / "ready.json").exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"raytrain serve did not come up (rc {proc.poll()}): {(d / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    info = {"url": f"http://127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "proc": proc,
            "log": d / "serve.log", "run_uri": run_uri, "summary": summary, "ft_summary": ft_summary}
    yield info
    if proc.poll() is None:  # the last test interrupts it; this is for a failed run
        proc.kill()
        proc.wait(timeout=30)
    log.close()


def test_serve_rejects_missing_or_incomplete_models(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "neither a model directory (no config.json) nor a run directory" in err and err.count("\n") == 1
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err
    assert "is incomplete: no weights" in err and err.count("\n") == 1
    assert main(["serve", "promote"]) == 2
    assert "needs --url" in capsys.readouterr().err
    # `serve run MODEL` is `serve MODEL`; an action and a model together, or run without one: one line each.
    assert main(["serve", "run", str(tmp_path / "half")]) == 2
    assert "is incomplete: no weights" in capsys.readouterr().err
    assert main(["serve", "run"]) == 2 and "serve run needs a MODEL" in capsys.readouterr().err
    assert main(["serve", "rollback", str(tmp_path / "half")]) == 2
    err = capsys.readouterr().err
    assert "one of run, promote, rollback, split first" in err and err.count("\n") == 1


def test_cluster_serve_config_matches_serves_schema_and_the_app_builder():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from raytrain.serving.app import app_builder

    doc = yaml.safe_load((ROOT / "cluster" / "serve" / "raytrain-serve.yaml").read_text())
    app = ServeDeploySchema.model_validate(doc).applications[0]
    assert app.import_path == "raytrain.serving.app:app_builder"
    assert {d.name for d in app.deployments} == {"model", "canary"}  # the names build() gives the versions
    with pytest.raises(ValueError, match="unknown \\['modle'\\], required 'model'"):
        app_builder({"modle": "s3://b/run"})


def test_openai_api_parses_shapes_and_streams_without_a_server():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from raytrain.serving import openai_api
    from raytrain.serving.fields import RequestError

    p = openai_api.parse_completion({"prompt": ["a b", [5, 6]], "n": 2, "seed": 4, "echo": True, "logprobs": 1,
                                     "stop": "x", "max_tokens": 0})
    reqs = p.requests()
    assert [("text" in r, r.get("ids"), r["seed"], r["stop"]) for r in reqs] == [
        (True, None, 4, ["x"]), (True, None, 5, ["x"]), (False, [5, 6], 4, ["x"]), (False, [5, 6], 5, ["x"])]
    result = {"prompt_pieces": ["a", " b"], "prompt_lp": [-1.0], "prompt_top": [{" b": -1.0}], "gen_pieces": ["c", "d"],
              "gen_lp": [-0.5, -0.25], "gen_top": [{"c": -0.5}, {"d": -0.25}], "continuation": "cd",
              "finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 2}
    out = openai_api.response(p, [result] * 4, "v1")
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["text"] == "a bcd" and lp["token_logprobs"] == [None, -1.0, -0.5, -0.25]
    assert lp["text_offset"] == [0, 1, 3, 4] and lp["top_logprobs"][0] is None
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}  # prompts once each
    p.stream = True
    events = list(openai_api.chunks(p, [result] * 4, "v1"))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == 0) == "a bcd"
    assert events[2]["choices"][0]["logprobs"]["text_offset"] == [4]
    # As a replica streams it: the echo once accepted, tokens as generated, the rest with the result.
    q = openai_api.parse_completion({"prompt": "a b", "echo": True, "stream": True,
                                     "stream_options": {"include_usage": True}})
    shape = openai_api.StreamShaper(q, "v1")
    out = shape.event(0, {"start": {"prompt_pieces": ["a", " b"], "prompt_tokens": 2}})
    out += shape.event(0, {"pieces": ["c"]}) + shape.event(0, {"result": result}) + shape.close()
    assert [c["choices"][0]["text"] for c in out[:-1]] == ["a b", "c", "d", ""] and out[-2]["choices"][0][
        "finish_reason"] == "length" and out[-1]["usage"]["completion_tokens"] == 2
    assert list(openai_api.sse(iter([])))[-1] == "data: [DONE]\n\n"
    with pytest.raises(RequestError, match="'n' must be an integer in \\[1, 16\\]") as e:
        openai_api.parse_completion({"prompt": "a", "n": 0})
    assert e.value.param == "n" and openai_api.error_body(422, "m", "n")["error"]["type"] == "invalid_request_error"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    msgs = [{"role": "user", "content": "hi"}]
    assert openai_api.render_chat(tok, msgs, fallback=openai_api.DEFAULT_CHAT_TEMPLATE) == "user: hi\nassistant:"
    with pytest.raises(RequestError, match="no chat template and the server was started with --chat-template none"):
        openai_api.render_chat(tok, msgs, fallback=None)


def test_stream_lets_out_each_token_once_no_stop_string_can_take_it_back():
    """A replica's token-by-token stream (no Ray): what it sends is always the start of what `finish` answers
    (cut at end-of-text or the earliest stop string), and with nothing to cut it sends every token at once."""
    import random

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from raytrain.serving import streaming

    vocab = {"<eot>": 0, "a": 1, "b": 2, "ab": 3, " ": 4, "ba": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<eot>"))
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eot>")
    rng = random.Random(0)
    for _ in range(400):
        gen = [rng.randrange(len(vocab)) for _ in range(rng.randrange(0, 12))]
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))]
        sent, seen = [], []
        feed = streaming.RowFeed(tok, eot=0, stops=stops, sink=lambda ev: sent.extend(ev["pieces"]))
        for x in gen:
            feed.add(x)
            seen.append(len(sent))
        r = streaming.finish(tok, gen, stops)
        assert sent == r["gen_pieces"][:len(sent)], (gen, stops, sent, r)
        if not stops:  # nothing can cut: each token goes out as it arrives, up to the end-of-text
            n = gen.index(0) if 0 in gen else len(gen)
            assert sent == r["gen_pieces"] and seen[:n] == list(range(1, n + 1)), (gen, sent)
    # The streamer generate() calls: the prompt first (skipped), then one token per row and step.
    rows = [[], []]
    s = streaming.streamer([streaming.RowFeed(tok, eot=0, stops=[], sink=lambda ev, k=k: rows[k].extend(ev["pieces"]))
                            for k in range(2)])
    for step in ([[1, 2], [2, 2]], [1, 3], [0, 4], [0, 5]):
        s.put(np.array(step))  # numpy stands in for generate()'s CPU tensors: the same reshape / tolist
    assert rows == [["a"], ["ab", " ", "ba"]] and streaming.streamer([None, None]) is None


@pytest.mark.slow
def test_curl_predict_answers_with_input_logprobs(server):
    text = "one two three four"
    if shutil.which("curl"):  # the launch guide's own line
        out = subprocess.run(["curl", "-s", "-X", "POST", f"{server['url']}/predict", "-H",
                              "Content-Type: application/json", "-d", json.dumps({"text": text})],
                             capture_output=True, text=True, timeout=60)
        body = json.loads(out.stdout)
    else:
        status, body = _post(server["url"], "/predict", {"text": text})
        assert status == 200
    assert body["version"] in (STABLE, CANARY)
    assert isinstance(body["continuation"], str) and 1 <= body["completion_tokens"] <= 16
    assert len(body["logprobs"]) == body["prompt_tokens"] - 1 == len(body["tokens"]) - 1
    assert all(-50 < lp <= 0 for lp in body["logprobs"])


@pytest.mark.slow
def test_openai_completions_models_and_health(server):
    url = server["url"]
    req = {"model": STABLE, "prompt": "three four", "max_tokens": 5, "temperature": 0.8, "seed": 7}
    status, a = _post(url, "/v1/completions", req)
    assert status == 200 and a["object"] == "text_completion" and a["model"] == a["version"] == STABLE
    assert a["choices"][0]["finish_reason"] in ("stop", "length") and isinstance(a["choices"][0]["text"], str)
    assert 1 <= a["usage"]["completion_tokens"] <= 5
    assert a["usage"]["total_tokens"] == a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"]
    _, b = _post(url, "/v1/completions", req)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]  # seeded sampling repeats
    status, models = _get(url, "/v1/models")
    by = {m["id"]: m for m in models["data"]}
    assert status == 200 and set(by) == {STABLE, CANARY}
    assert by[STABLE]["step"] == 5 and by[CANARY]["step"] == 10
    assert by[STABLE]["lineage"] and by[CANARY]["lineage"] and by[STABLE]["lineage"] != by[CANARY]["lineage"]
    assert by[STABLE]["params"] == server["summary"]["params"] and by[CANARY]["params"] == server["ft_summary"]["params"]
    assert (by[STABLE]["role"], by[CANARY]["role"], by[CANARY]["traffic"]) == ("stable", "canary", 0.5)
    status, health = _get(url, "/healthz")
    assert status == 200 and health["status"] == "ok"


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_served_fine_tune_leads_to_both_datasets_raw_files(run, server, corpus_dir, capsys):
    """Lineage (raytrain/lineage.py): the served canary, a LoRA fine-tune of the stable run's export, exported too;
    its lineage.json leads to the chat data's raw file and, through the base's own lineage, to the pre-training
    corpus files, each with its size and sha256; /v1/models shows the same id; a changed input is reported."""
    from raytrain import lineage
    from raytrain.export import export

    run_uri, _, ft_uri, _ = run
    root = Path(run_uri).parent
    model = root / "ft-export"
    out = export(catalog.latest_complete(ft_uri).uri, str(model), log=lambda *_: None)
    lin = json.loads((model / "lineage.json").read_text())
    assert lin["id"] == out["lineage"] == lineage.lineage_id(lin)
    _, models = _get(server["url"], "/v1/models")
    assert {m["id"]: m["lineage"] for m in models["data"]}[CANARY] == lin["id"]  # served from the run: the same id
    inputs = lambda li: {i["uri"]: i for s in li["data"] for i in s["inputs"]}  # noqa: E731
    chats = root / "chats.jsonl"
    assert inputs(lin) == {str(chats): {"uri": str(chats), "bytes": chats.stat().st_size, "sha256": _sha(chats)}}
    assert lin["base"]["uri"] == str(root / "base") and lin["base"]["lineage"]["base"] is None
    pre = inputs(lin["base"]["lineage"])
    assert set(pre) == {str(p) for p in corpus_dir.iterdir()}
    assert all(pre[u]["sha256"] == _sha(Path(u)) and pre[u]["bytes"] == Path(u).stat().st_size for u in pre)
    capsys.readouterr()
    assert main(["lineage", str(model)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"lineage {lin['id']}: model {model}") and "\n0 of " in text and "changed since" in text
    assert main(["check", str(model), "-n", "1", "--max-new-tokens", "2"]) == 0  # the release gate names it too
    assert f"lineage {lin['id']}" in capsys.readouterr().out
    # A pre-training file edited: reported as changed, through the base (exit 1); then as before.
    edited = sorted(corpus_dir.iterdir())[0]
    saved = edited.read_bytes()
    try:
        edited.write_bytes(saved + b" edited")
        assert main(["lineage", str(model), "--json"]) == 1
        (changed,) = json.loads(capsys.readouterr().out)["changed"]
        assert (changed["uri"], changed["status"], changed["where"]) == (str(edited), "changed", "fine-tuned > served")
    finally:
        edited.write_bytes(saved)
    assert main(["lineage", str(model), "--json"]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_check_url_passes_with_consistent_logprobs(server, tmp_path, capsys):
    rc = main(["check", "--url", server["url"], "--requests", "40", "--concurrency", "4", "--samples", "4",
               "--max-p99-ms", "1e9", "--report-dir", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, [c for c in out["checks"] if not c["ok"]]
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["consistency"]["ok"] and out["consistency_max_abs_diff"] <= 1e-4
    assert all(checks[c]["ok"] for c in ("echo", "stream", "chat")) and "as one list" in checks["consistency"]["detail"]
    assert "held-out" not in checks["consistency"]["detail"] and "/val" in checks["consistency"]["detail"]
    assert out["load"]["errors"] == 0 and out["load"]["ok"] == 40
    assert out["load"]["p50_ms"] <= out["load"]["p99_ms"] and out["cold_ms"] > 0
    saved = json.loads((tmp_path / "launch_check.json").read_text())
    assert saved["ok"] and "| warm p99 |" in (tmp_path / "launch_check.md").read_text()
    # The bar is enforced: an impossible P99 fails the check.
    assert main(["check", "--url", server["url"], "--requests", "4", "--samples", "1", "--max-p99-ms", "0.001",
                 "--report-dir", str(tmp_path / "strict")]) == 1
    assert "FAIL  latency" in capsys.readouterr().out


@pytest.mark.slow
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server):
    url = server["url"]
    long_text = " ".join(["one two three"] * 20)
    cases = [
        ("malformed JSON", b'{"text": "one', "application/json", 400, "not valid JSON"),
        ("missing text", {"txt": "one"}, "application/json", 422, "'text'"),
        ("too long", {"text": long_text}, "application/json", 413, "exceeds the model's context of 32 tokens"),
        ("unknown version", {"text": "one", "version": "v9"}, "application/json", 404, "unknown version 'v9'"),
        ("wrong content type", {"text": "one"}, "text/plain", 415, "Content-Type: application/json"),
        ("not an object", [1, 2], "application/json", 400, "JSON object"),
    ]
    for name, body, ctype, want, reason in cases:
        status, out = _post(url, "/predict", body, ctype)
        assert status == want and reason in out["error"] and "\n" not in out["error"], (name, status, out)
        status, ok = _post(url, "/predict", {"text": "one two"})
        assert status == 200 and ok["continuation"] is not None, (name, ok)
    status, out = _post(url, "/v1/completions", {"prompt": "one", "max_tokens": -1})
    assert status == 422 and "max_tokens" in out["error"]["message"]  # /v1/* errors are OpenAI error objects
    status, out = _get(url, "/nowhere")
    assert status == 404
    # Traffic changes need a credential, also from this machine's loopback address: the Ray token (401 without it),
    # or, with token authentication off, none is accepted (403).
    status, out = _post(url, "/admin/rollback", {})
    assert (status == 401 and "Ray auth token" in out["error"]) or (
        status == 403 and "RAY_AUTH_MODE=token" in out["error"]), (status, out)
    # Requests by status and version reach Ray's Prometheus export (Ray adds its `ray_` prefix).
    def exported() -> list[str]:
        with urllib.request.urlopen(server["metrics"], timeout=10) as r:
            return [x for x in r.read().decode().splitlines() if x.startswith("ray_model_")]

    def complete(lines: list[str]) -> bool:
        counts = [x for x in lines if x.startswith("ray_model_requests_total{")]
        return (any('status="200"' in x and f'version="{STABLE}"' in x for x in counts)
                and all(any(f'status="{s}"' in x and 'version="none"' in x for x in counts) for s in (400, 415))
                # too long is found out by the replica: it counts against the version it was routed to
                and any('status="413"' in x and 'version="none"' not in x for x in counts)
                and any(x.startswith("ray_model_request_latency_ms_bucket{") for x in lines)
                and any(x.startswith("ray_model_generated_tokens_total{") for x in lines))

    deadline, lines = time.time() + 40, []
    while time.time() < deadline and not complete(lines):
        time.sleep(1)
        lines = exported()
    assert complete(lines), lines


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _offline(server, version: str = STABLE):
    """A version's exported model and tokenizer, loaded as `raytrain eval` loads them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, models = _get(server["url"], "/v1/models")
    src = {m["id"]: m for m in models["data"]}[version]["source"]
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(src)


@pytest.mark.slow
def test_openai_client_completions_echo_logprobs_equal_offline(server, client):
    from raytrain.serving.check import offline_logprobs

    model, tok = _offline(server)
    texts = ["one two three four", "five six seven", "eight nine ten eleven twelve"]
    single = client.completions.create(model=STABLE, prompt=texts[0], max_tokens=0, echo=True, logprobs=2)
    listed = client.completions.create(model=STABLE, prompt=texts, max_tokens=0, echo=True, logprobs=2)
    ids = client.completions.create(model=STABLE, prompt=[tok(t)["input_ids"] for t in texts[:2]], max_tokens=0,
                                    echo=True, logprobs=0)
    assert [c.text for c in listed.choices] == texts and single.choices[0].text == texts[0]
    assert [c.text for c in ids.choices] == texts[:2]
    for resp, want in ((single, texts[:1]), (listed, texts), (ids, texts[:2])):
        for c, text in zip(resp.choices, want):
            lp = c.logprobs
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens) == text
            assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
            offline = offline_logprobs(model, tok, text)
            assert len(lp.token_logprobs) - 1 == len(offline)
            assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], offline)) <= 1e-4
            assert all(d[t] == pytest.approx(v, abs=1e-6) and v <= max(d.values()) + 1e-6  # the chosen is in
                       for t, v, d in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert all(1 <= len(d) <= 3 for d in listed.choices[0].logprobs.top_logprobs[1:])  # top 2 plus the chosen
    assert listed.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    assert listed.usage.completion_tokens == 0


@pytest.mark.slow
def test_openai_client_completions_plain_stop_n_and_generated_logprobs(server, client):
    plain = client.completions.create(model=STABLE, prompt="one two three", max_tokens=6, temperature=0)
    c = plain.choices[0]
    assert plain.object == "text_completion" and plain.model == STABLE and c.finish_reason in ("stop", "length")
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    with_lp = client.completions.create(model=STABLE, prompt="one two three", max_tokens=6, temperature=0, logprobs=1)
    assert with_lp.choices[0].text == c.text and "".join(with_lp.choices[0].logprobs.tokens) == c.text
    assert all(lp is not None and lp <= 0 for lp in with_lp.choices[0].logprobs.token_logprobs)
    assert len(c.text.strip()) >= 3, c.text  # the trained tiny model continues its counting text
    stop = c.text.strip()[1:3]  # a stop string taken from the greedy text: cut there, not returned
    cut = client.completions.create(model=STABLE, prompt="one two three", max_tokens=6, temperature=0,
                                    stop=[stop, "\u2603"])
    assert cut.choices[0].text == c.text[:c.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens <= plain.usage.completion_tokens
    two = client.completions.create(model=STABLE, prompt=["one two", "three four"], max_tokens=4, n=2,
                                    temperature=0.9, top_p=0.9, seed=3)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3] and all(isinstance(ch.text, str) for ch in two.choices)
    again = client.completions.create(model=STABLE, prompt=["one two", "three four"], max_tokens=4, n=2,
                                      temperature=0.9, top_p=0.9, seed=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in two.choices]


@pytest.mark.slow
def test_openai_client_streams_concatenate_to_the_unstreamed_text(server, client):
    args = {"model": STABLE, "prompt": "two three four", "max_tokens": 8, "temperature": 0.8, "seed": 11}
    whole = client.completions.create(**args).choices[0]
    parts = list(client.completions.create(**args, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.text
    assert parts[-1].choices[0].finish_reason == whole.finish_reason
    # Token by token as generated: the first token's chunk comes about when a one-token answer would, not
    # when the whole answer would (sent at the end, its chunks still arrive spread out: each crosses Serve's
    # hops on its own). The fastest of three rounds each, so a stall of a loaded machine does not decide.
    def timed(max_tokens: int, stream: bool) -> float:
        t0 = time.perf_counter()
        if not stream:
            client.completions.create(model=STABLE, prompt="two", max_tokens=max_tokens, temperature=0)
            return time.perf_counter() - t0
        seen = [(time.perf_counter() - t0, p.choices[0].text) for p in client.completions.create(
            model=STABLE, prompt="two", max_tokens=max_tokens, temperature=0, stream=True)]
        assert sum(1 for _, text in seen if text) >= 12, seen  # a long continuation
        return next(t for t, text in seen if text)

    rounds = [(timed(1, False), timed(28, True), timed(28, False)) for _ in range(3)]
    one, first, whole = (min(r[k] for r in rounds) for k in range(3))
    assert first < one + (whole - one) * 2 / 3, rounds
    chat_args = {"model": STABLE, "messages": [{"role": "user", "content": "one two"}], "max_completion_tokens": 6,
                 "temperature": 0.7, "seed": 5}
    chat = client.chat.completions.create(**chat_args)
    msg = chat.choices[0].message
    assert chat.object == "chat.completion" and msg.role == "assistant" and isinstance(msg.content, str)
    assert chat.choices[0].finish_reason in ("stop", "length") and 1 <= chat.usage.completion_tokens <= 6
    deltas = list(client.chat.completions.create(**chat_args, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    raw = urllib.request.urlopen(urllib.request.Request(
        server["url"] + "/v1/completions", data=json.dumps({**args, "stream": True}).encode(),
        headers={"Content-Type": "application/json"}), timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.read().decode().rstrip().endswith("data: [DONE]")
    # The exported model carries raytrain's chat template: the prompt is the rendered conversation.
    _, tok = _offline(server)
    n = len(tok(tok.apply_chat_template(chat_args["messages"], tokenize=False, add_generation_prompt=True))["input_ids"])
    assert chat.usage.prompt_tokens == n and "assistant:" in tok.chat_template


@pytest.mark.slow
def test_openai_bad_input_is_an_openai_error_and_the_next_request_is_answered(server, client):
    import openai

    bad = [
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"prompt": [[1, "x"]]}, "prompt"),
        ("completions", {"prompt": "one", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "one", "logprobs": 99}, "logprobs"),
        ("completions", {"prompt": "one", "stop": 5}, "stop"),
        ("completions", {"prompt": "one", "n": 0}, "n"),
        ("completions", {"prompt": "one", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": [[99999]]}, "prompt"),
        ("completions", {"prompt": "one", "model": "v9"}, None),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ("completions", {"prompt": " ".join(["one two three"] * 20)}, None),
    ]
    for kind, body, param in bad:
        create = client.completions.create if kind == "completions" else client.chat.completions.create
        body = {"model": STABLE, **body} if "model" not in body else body
        with pytest.raises(openai.APIStatusError) as e:
            create(**body)
        err = e.value.response.json()["error"]
        assert 400 <= e.value.status_code < 500 and set(err) == {"message", "type", "param", "code"}, (body, err)
        assert err["code"] == e.value.status_code and err["param"] == param and "\n" not in err["message"], (body, err)
        ok = client.completions.create(model=STABLE, prompt="one two", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length"), body
    status, out = _post(server["url"], "/v1/completions", b'{"prompt": "one', "application/json")
    assert status == 400 and "not valid JSON" in out["error"]["message"]


@pytest.mark.slow
def test_the_lora_fine_tune_answers_chat_as_its_merged_export_does(server, client):
    """The canary is a LoRA fine-tune on chat examples: served merged (a plain model directory, no adapter), it answers
    chat requests through the official client, its prompt is the conversation rendered as in training, and its
    log-probabilities are the merged model's offline."""
    from raytrain.serving.check import offline_logprobs

    model, tok = _offline(server, CANARY)
    _, models = _get(server["url"], "/v1/models")
    src = Path({m["id"]: m for m in models["data"]}[CANARY]["source"])
    assert (src / "config.json").is_file() and not (src / "adapter_config.json").exists()  # merged
    assert server["ft_summary"]["trainable_params"] < server["ft_summary"]["params"] / 4  # only the adapter trained
    messages = [{"role": "user", "content": "three"}]
    chat = client.chat.completions.create(model=CANARY, messages=messages, max_completion_tokens=6, temperature=0)
    msg = chat.choices[0].message
    assert chat.model == CANARY and msg.role == "assistant" and isinstance(msg.content, str)
    assert 1 <= chat.usage.completion_tokens <= 6 and chat.choices[0].finish_reason in ("stop", "length")
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(tok(rendered)["input_ids"])
    again = client.chat.completions.create(model=CANARY, messages=messages, max_completion_tokens=6, temperature=0)
    assert again.choices[0].message.content == msg.content  # greedy: the same answer
    text = rendered + msg.content
    echo = client.completions.create(model=CANARY, prompt=text, max_tokens=0, echo=True, logprobs=0).choices[0]
    offline = offline_logprobs(model, tok, text)
    assert max(abs(a - b) for a, b in zip(echo.logprobs.token_logprobs[1:], offline)) <= 1e-4


@pytest.mark.slow
def test_canary_then_rollback_under_load_fails_no_request(server, capsys):
    url = server["url"]
    assert main(["serve", "split", "--url", url, "--canary-fraction", "0.5"]) == 0
    assert f"stable {STABLE}, canary {CANARY} at 50%" in capsys.readouterr().out
    n, results, lock = 240, [], threading.Lock()
    rolled_back = threading.Event()

    def one(i):
        after = rolled_back.is_set()
        try:
            status, body = _post(url, "/predict", {"text": "five six seven", "max_new_tokens": 4})
        except OSError as e:
            status, body = 0, {"error": str(e)}
        with lock:
            results.append((after, status, body.get("version")))

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        while len(results) < n // 3:
            time.sleep(0.05)
        assert main(["serve", "rollback", "--url", url]) == 0  # while requests are in flight
        rolled_back.set()
        for f in futures:
            f.result()
    assert "no canary" in capsys.readouterr().out
    failed = [r for r in results if r[1] != 200]
    assert len(results) == n and not failed, failed[:5]
    assert {v for _, _, v in results} == {STABLE, CANARY}
    after = [v for a, _, v in results if a]
    assert after and set(after) == {STABLE}  # sent after the rollback: only the stable version answers
    assert main(["serve", "promote", "--url", url]) == 2  # nothing left to promote
    assert "no canary to promote" in capsys.readouterr().err


@pytest.mark.slow
def test_interrupt_stops_the_application_cleanly(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0
    assert "stopping: deleting the Serve application" in server["log"].read_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(server["url"] + "/healthz", timeout=5)
