"""Helpers the tests share: a synthetic learnable corpus, the smallest useful run, free ports, a moto S3 server.

Imported by the tests and by conftest.py (which holds only fixtures).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from raytrain.config import load_config

WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def synthetic_docs(n_docs: int = 120, seed: int = 0) -> list[str]:
    """Counting sequences starting at random words: easy to learn, so loss must fall fast."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        start = rng.randrange(len(WORDS))
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(rng.randrange(40, 120))) + ".")
    return docs


def tiny_overrides(data: Path | str, storage: Path | str, name: str, *overrides: str) -> list[str]:
    """The overrides of the smallest useful run (recipe `tiny`), as `raytrain train` takes them."""
    return [
        f"data.train={data}/train", f"data.val={data}/val", f"checkpoint.storage={storage}", f"run.name={name}",
        "model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32",
        "batch.micro_batch_size=4", "optim.lr=3e-3", "optim.warmup_steps=2", "run.log_every=1",
        "run.eval_every=0", "data.eval_samples=16", "checkpoint.every_n_steps=5", "run.max_steps=10",
        "run.max_failures=0", "checkpoint.memory_every_n_steps=1", *overrides,
    ]


# The session's reference run (conftest.reference_run): what a run compared with it must share besides the data.
REFERENCE = ("run.max_steps=12", "checkpoint.every_n_steps=4")


def tiny_cfg(data: Path | str, storage: Path | str, name: str, *overrides: str):
    """The smallest useful run: 2 workers, ZeRO-2, a 1-layer GPT on 32-token sequences."""
    return load_config("tiny", tiny_overrides(data, storage, name, *overrides))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The session S3 server's request record (conftest.s3_server): one per pytest process.
S3_RECORD = os.path.join(tempfile.gettempdir(), f"raytrain-test-s3-{os.getpid()}.log")


def start_moto(log_path: Optional[str] = None, record_path: Optional[str] = None) -> tuple[subprocess.Popen, str]:
    """Start a moto S3 server on a free 127.0.0.1 port; returns (process, endpoint) once it listens. With log_path,
    its request log (one line per request) goes there; with record_path, each request's arrival time, method and
    path (tests/moto_recorded.py; `s3_requests` reads it)."""
    port = free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    if record_path is not None:
        proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "moto_recorded.py"),
                                 "127.0.0.1", str(port), record_path], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    elif log_path is None:
        proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    else:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("moto_server did not start")


def s3_requests(record_path: str, t0: float, t1: float) -> list[str]:
    """The requests a recording moto server (start_moto(record_path=...)) received between t0 and t1 (unix times)."""
    with open(record_path) as f:
        return [line.strip() for line in f if t0 < float(line.split(" ", 1)[0]) < t1 and " SENT " not in line]


def s3_bytes_sent(record_path: str, t0: float, t1: float, prefix: str) -> dict[str, int]:
    """{path: response body bytes} the recording moto server sent between t0 and t1 for paths under prefix."""
    out: dict[str, int] = {}
    with open(record_path) as f:
        for line in f:
            t, kind, *rest = line.split()
            if kind == "SENT" and t0 < float(t) < t1 and rest[1].startswith(prefix):
                out[rest[1]] = out.get(rest[1], 0) + int(rest[0])
    return out


def ensure_prometheus() -> tuple[str, str]:
    """Paths of prometheus and promtool; installs Debian's package when missing, else skips with the reason."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("Prometheus is not installed and cannot be (needs root and apt-get): apt-get install prometheus")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"], env=env,
                         capture_output=True, text=True, timeout=600)
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        pytest.skip(f"apt-get install prometheus failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return prom, tool


MLFLOW_SERVER = "mlflow==3.17.2"  # full mlflow pins pyarrow<26; raytrain needs >=26, so its server lives apart


_MLFLOW_ROOT = Path(__file__).resolve().parent.parent / ".venv" / "tools" / "mlflow"
_mlflow_install: Optional[subprocess.Popen] = None


def start_mlflow_server_install() -> None:
    """Begin making the MLflow server's venv (below) in the background, so the ~1 min of pip overlaps the tests
    that run before the first one needing it. Does nothing when it is made already."""
    global _mlflow_install
    if _mlflow_install is not None or (_MLFLOW_ROOT / ".ready").exists():
        return
    root = _MLFLOW_ROOT
    # Complete only once .ready exists: a killed install is started again from scratch, never taken as made.
    # --no-compile: pip byte-compiles every file (~65 s of a core beside the tests); the server's first start compiles
    # only what it imports (~15 s), cached for the next.
    script = (f'rm -rf "{root}" && "{sys.executable}" -m venv "{root}" && '
              f'"{root}/bin/python" -m pip install -q --no-compile "{MLFLOW_SERVER}" && touch "{root}/.ready"')
    _mlflow_install = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)


def mlflow_server_exe() -> str:
    """The `mlflow` command of a venv of its own under .venv/tools/ (made on first use or from the session's start,
    ~1-2 min, then reused): a real tracking server for the tests, whose pins need not agree with raytrain's. Skips
    with the reason when it cannot be installed."""
    exe = _MLFLOW_ROOT / "bin" / "mlflow"
    if not (_MLFLOW_ROOT / ".ready").exists():
        start_mlflow_server_install()
        try:
            _, err = _mlflow_install.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            _mlflow_install.kill()
            err = "timed out after 900 s"
        if not (_MLFLOW_ROOT / ".ready").exists():
            shutil.rmtree(_MLFLOW_ROOT, ignore_errors=True)
            detail = (err or "").strip().splitlines()[-1:]
            pytest.skip(f"could not install an MLflow server ({MLFLOW_SERVER}) into {_MLFLOW_ROOT}: {detail}")
    return str(exe)


def write_lm_eval_tasks(d: Path, task: str = "raytrain_tiny_mc", data: Optional[Path] = None) -> Path:
    """A directory of lm-evaluation-harness task YAMLs over the JSONL the tests ship (no Hub download on these
    machines): `raytrain_tiny_mc`, a 24-question multiple-choice task (or `task` over `data`: JSONL of question,
    choices, answer). Returns d."""
    data = data or Path(__file__).parent / "data" / "lm_eval" / "raytrain_tiny_mc.jsonl"
    (d / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return d


def tensorboard_scalars(d: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over the event files in d, oldest file first (a step an attempt wrote again: its value)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(d.glob("events.out.tfevents.*")):  # named by their creation time
        data, i = path.read_bytes(), 0
        while i < len(data):
            n = int.from_bytes(data[i:i + 8], "little")
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                scalars.setdefault(v.tag, {})[ev.step] = v.simple_value
    return scalars


def assert_traced(run_uri: str, steps) -> dict:
    """`raytrain data trace` of each step, checked against the data: every row covered by its spans, the row's
    tokens at each span equal to its document (read again from the raw input, tokenized) at that span, and the
    reconstructed batch's content checksum equal to the one logged at that step (where it was a log step).
    Returns {step: trace}."""
    import numpy as np
    from tokenizers import Tokenizer

    from raytrain.data.provenance import Provenance, document_text
    from raytrain.data.trace import RunData, trace

    run = RunData(run_uri)
    _, splits, names = run.plan
    tok = Tokenizer.from_str(open(splits[0].tokenizer_uri).read())
    prepares = {}
    encoded: dict = {}
    out = {}
    for step in steps:
        t = trace(run_uri, step)
        assert t["checksum_matches"] is not False, (step, t["content_checksum"], t["logged_content_checksum"])
        if run.logged(step) is not None:
            assert t["checksum_matches"] is True, step
        rows = t["_tokens"]
        assert len(t["rows"]) == run.gb == len(rows)
        for r in t["rows"]:
            row, at = rows[r["lane"]], 0
            for s in r["spans"]:
                assert s["pos"] == at, (step, r)
                at += s["len"]
                key = (s["source"], s["record"])
                if key not in encoded:
                    split = splits[names.index(r["source_name"]) if "source_name" in r else 0]
                    prep = prepares.setdefault(split.uri, Provenance(split.uri).prepare)
                    text = document_text(s["source"], s["record"], prep)
                    assert text.startswith(s["head"])
                    encoded[key] = np.array(tok.encode(text).ids + [split.eot_id])
                want = encoded[key][s["doc_start"]:s["doc_start"] + s["len"]]
                assert np.array_equal(row[s["pos"]:s["pos"] + s["len"]], want), (step, r["lane"], s)
            assert at == row.shape[0], (step, r)  # the spans cover the row
        out[step] = t
    return out
