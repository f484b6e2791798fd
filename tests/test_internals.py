"""Reaches into other packages' private code: only in raytrain/internals, each registered with its version and gated,
and each falling back as its registration says when its gate is closed (RAYTRAIN_INTERNALS=stock, another version).
The forced-mismatch training run and the snapshot that one rank cannot apply are in tests/test_train.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raytrain"
INTERNALS = PACKAGE / "internals"
# Private-looking names the standard library documents (os._exit, namedtuple's methods).
STDLIB_PUBLIC = {"_exit", "_asdict", "_replace", "_fields", "_make"}
# Ray's environment variables that its documentation names (cluster address, token authentication, TLS, the temp
# directory, a job's submission id); any other RAY_* name is one of its internal constants, a reach.
RAY_PUBLIC_ENV = {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_USE_TLS",
                  "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT", "RAY_TMPDIR", "RAY_SUBMISSION_ID"}


def private_reaches(root: Path, skip: Path | None = None) -> list[str]:
    """Every private reach into another package in the .py files under `root` (but `skip`): imports of private
    modules or names, sys.modules subscripts and writes, private attributes raytrain itself never defines, and
    assignments to attributes of imported third-party modules."""
    files = [p for p in sorted(root.rglob("*.py")) if skip is None or skip not in p.parents]
    trees = {p: ast.parse(p.read_text()) for p in files}
    ours = _names_defined(trees.values())
    found = []
    for p, tree in trees.items():
        modules = _third_party_module_names(tree)
        for n in ast.walk(tree):
            why = _reach(n, ours, modules)
            if why:
                found.append(f"{p.relative_to(root.parent)}:{n.lineno} {why}")
    return found


def _names_defined(trees) -> set[str]:
    """Names raytrain defines itself (functions, classes, attributes it assigns, arguments): its own private names."""
    names = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
    return names


def _third_party(module: str) -> bool:
    return bool(module) and not module.startswith(("raytrain", "__future__")) and module.split(".")[0] not in \
        sys.stdlib_module_names


def _third_party_module_names(tree) -> set[str]:
    """Local names bound to third-party modules by `import x` / `import x.y as z`."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if _third_party(a.name):
                    out.add(a.asname or a.name.split(".")[0])
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reach(n, ours: set[str], modules: set[str]) -> str | None:
    if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("RAY_") \
            and n.value.isupper() and " " not in n.value and n.value not in RAY_PUBLIC_ENV:
        return f"Ray-internal environment variable {n.value}"
    if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
            ast.unparse(n.value).split(".")[-1] == "engine":  # a DeepSpeed engine's own state written
        return f"engine attribute set: {ast.unparse(n)}"
    if isinstance(n, ast.Import):
        bad = [a.name for a in n.names if _third_party(a.name) and any(_private(part) for part in a.name.split("."))]
        return f"import {bad[0]}" if bad else None
    if isinstance(n, ast.ImportFrom) and not n.level and _third_party(n.module or ""):
        if any(_private(part) for part in n.module.split(".")):
            return f"from {n.module} import ..."
        bad = [a.name for a in n.names if _private(a.name)]
        return f"from {n.module} import {bad[0]}" if bad else None
    if isinstance(n, ast.Subscript) and ast.unparse(n.value) == "sys.modules":
        return f"sys.modules[...] ({type(n.ctx).__name__})"
    if isinstance(n, ast.Call) and ast.unparse(n.func) in ("sys.modules.setdefault", "sys.modules.pop",
                                                           "sys.modules.update"):
        return ast.unparse(n.func)
    if isinstance(n, ast.Attribute):
        if _private(n.attr) and n.attr not in ours and n.attr not in STDLIB_PUBLIC:
            return f"private attribute .{n.attr}"
        if isinstance(n.ctx, ast.Store) and isinstance(n.value, (ast.Name, ast.Attribute)) \
                and ast.unparse(n.value).split(".")[0] in modules:
            return f"module global set: {ast.unparse(n)}"
    if isinstance(n, ast.Call) and ast.unparse(n.func) == "vars" and n.args and isinstance(n.args[0], (ast.Name, ast.Attribute)):
        base = ast.unparse(n.args[0]).split(".")[0]
        return f"vars({ast.unparse(n.args[0])})" if base in modules else None
    return None


def test_no_private_reach_outside_the_internals_package():
    """The static count over raytrain/ but raytrain/internals (33 before issue 43, by the issue's count; 0 now)."""
    found = private_reaches(PACKAGE, skip=INTERNALS)
    assert found == [], "\n".join(found)


def test_the_scanner_finds_each_kind_of_reach(tmp_path):
    pkg = tmp_path / "raytrain"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "import sys\nimport deepspeed.ops\nfrom ray._private import worker\nfrom ray.train import _x\n"
        "import ray._raylet\nsys.modules['mlflow'] = None\nvars(deepspeed.ops)['t'] = 1\ndeepspeed.ops.flag = 1\n"
        "def f(run, cb):\n    cb._stop_timeout = 2\n    return run.data._metric_objs\n"
        "def g(self, os):\n    os.environ['RAY_TRAIN_V2_ENABLED'] = '1'\n    self.engine.global_steps = 3\n"
        "    return os.environ.get('RAY_ADDRESS')\n")
    got = private_reaches(pkg)
    kinds = ["from ray._private", "from ray.train import _x", "import ray._raylet", "sys.modules", "vars(deepspeed.ops)",
             "module global set", ".data._metric_objs"[6:], "environment variable RAY_TRAIN_V2_ENABLED",
             "engine attribute set: self.engine.global_steps"]
    for kind in kinds:
        assert any(kind in line for line in got), (kind, got)
    assert not any("_stop_timeout" in line for line in got)  # assigned here, so "ours" to this toy tree
    assert not any("RAY_ADDRESS" in line for line in got)  # documented


def test_every_reach_is_registered_against_the_pinned_version():
    from raytrain.internals.registry import load_all

    pins = {}
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        if "==" in dep:
            name, version = dep.split("==")
            pins[name.split("[")[0].strip().lower()] = version.split(";")[0].strip()
    reaches = load_all()
    assert reaches and {r.package for r in reaches.values()} <= {"ray", "deepspeed"}
    for r in reaches.values():
        assert r.written_for == pins[r.package], r
        assert r.gain and r.fallback, r
    # Every module of the package but the registry registers what it reaches.
    modules = {p.stem for p in INTERNALS.glob("*.py")} - {"__init__", "registry"}
    assert modules == {"ray", "deepspeed"}
    for m in modules:
        tree = ast.parse((INTERNALS / f"{m}.py").read_text())
        assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "register" for n in ast.walk(tree)), m


def test_a_gate_is_open_on_the_pinned_version_and_closed_on_another_or_when_forced(monkeypatch, capsys):
    from raytrain.internals import registry
    from raytrain.internals.ray import INTERNAL_KV

    monkeypatch.setattr(registry, "_WARNED", set())
    monkeypatch.delenv(registry.FORCE_ENV, raising=False)
    assert registry.gate(INTERNAL_KV)
    monkeypatch.setattr(registry, "installed", lambda package: "9.9.9")
    assert not registry.gate(INTERNAL_KV) and not registry.gate(INTERNAL_KV)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "ray 9.9.9 installed, written for 2.60.0" in err and "not recorded" in err
    # A reach that raises takes its fallback, once said.
    monkeypatch.setattr(registry, "installed", lambda package: registry.REACHES[INTERNAL_KV].written_for)
    monkeypatch.setattr(registry, "_WARNED", set())
    assert registry.guarded(INTERNAL_KV, lambda: 1 / 0, lambda: "stock") == "stock"
    assert "ZeroDivisionError" in capsys.readouterr().err
    monkeypatch.setenv(registry.FORCE_ENV, "stock")
    assert registry.guarded(INTERNAL_KV, lambda: "reach", lambda: "stock") == "stock"


PROBE = """
import json, os, sys
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()
import deepspeed.ops
import deepspeed.autotuning.autotuner as tuner
print(json.dumps({"dir": os.environ.get("TORCH_EXTENSIONS_DIR"), "mlflow": "mlflow" in sys.modules,
                  "tuner_mlflow": tuner.has_mlflow,
                  "shm_op_off": vars(deepspeed.ops).get("__compatible_ops__", {}).get("deepspeed_shm_comm") is False}))
"""


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "RAYTRAIN_INTERNALS")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def test_deepspeed_import_without_mlflow_and_shm_op_and_stock_when_forced(tmp_path):
    """As a training worker imports DeepSpeed: built ops cached in this venv (a user's folder wins), its autotuner
    kept from importing mlflow (1.6-2 s of every worker start here), its CPU shm op marked unbuildable (45-100 s of
    gcc). Forced stock: DeepSpeed imports mlflow and may build the op, as it does by itself; one warning each."""
    got = _probe()
    if sys.prefix != sys.base_prefix:  # the suite runs in .venv; a system Python keeps torch's default
        assert got["dir"] == os.path.join(sys.prefix, "torch_extensions")
    assert not got["mlflow"] and not got["tuner_mlflow"] and got["shm_op_off"] and "warning" not in got["stderr"]
    assert _probe(TORCH_EXTENSIONS_DIR=str(tmp_path))["dir"] == str(tmp_path)
    stock = _probe(RAYTRAIN_INTERNALS="stock")
    assert stock["tuner_mlflow"] == (subprocess.run([sys.executable, "-c", "import mlflow"]).returncode == 0)
    assert not stock["shm_op_off"]
    assert stock["stderr"].count("deepspeed.no_mlflow_at_import off") == 1
    assert stock["stderr"].count("deepspeed.no_shm_comm_op off") == 1


@pytest.fixture
def stock(monkeypatch):
    from raytrain.internals import registry

    monkeypatch.setenv(registry.FORCE_ENV, "stock")
    monkeypatch.setattr(registry, "_WARNED", set())


def test_auth_check_fails_closed(stock, monkeypatch):
    """Without Ray's own check, the serving admin token must equal this machine's token; none here: refused."""
    from raytrain.internals.ray import token_auth_enabled, valid_request_token

    assert token_auth_enabled()
    assert valid_request_token("Bearer abc", "abc")
    assert not valid_request_token("Bearer abd", "abc") and not valid_request_token("Bearer ", None)
    assert not valid_request_token("", "")


def test_memory_snapshots_of_zero_engines_are_refused_when_forced(stock):
    """ZeRO's internals gated: no ZeRO optimizer counts as one the memory tier can capture, and a snapshot taken
    before is refused with a reason (every rank then restores from storage, tests/test_train.py)."""
    from raytrain.ckpt.host_snapshots import check, engine_kind

    class DeepSpeedZeroOptimizer:  # what the engine's optimizer is called; its internals are what is gated
        pass

    class Engine:
        optimizer = DeepSpeedZeroOptimizer()

    assert engine_kind(Engine()) is None
    from raytrain.ckpt.host_snapshots import FORMAT

    reason = check(Engine(), {"format": FORMAT, "kind": "zero", "optimizer": {"x": 1}})
    assert reason and "not the version" in reason


def test_restart_phase_clock_and_trial_abort_are_off_when_forced(stock):
    from raytrain.restart_phases import make_clock, read
    from raytrain.sweep.trial import _announce_controller

    assert make_clock("/tmp/run") is None and read("/tmp/run") is None
    assert _announce_controller(object()) is None


def test_drain_notices_come_from_rays_public_call_every_few_steps_when_forced(stock, monkeypatch):
    """The local read of the worker's Train context gated: Ray's public get_preemption_info(), a barrier, on the
    same steps on every rank."""
    import ray.train

    from raytrain.worker.preemption import PUBLIC_POLL_STEPS, PreemptionNotice

    calls = []

    class Info:
        deadline_ms, preempted_ranks = None, [1]

    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: calls.append(1) or Info())
    notice = PreemptionNotice(0, enabled=False)
    notice.enabled = True  # (no SIGTERM handler outside a worker)
    assert notice.flags(PUBLIC_POLL_STEPS - 1) == (False, False, False) and calls == []
    assert notice.flags(PUBLIC_POLL_STEPS) == (False, True, False) and len(calls) == 1
    notice.heard(False, True)
    assert notice.take().startswith("node drain for preemption (ranks [1]")


# A fresh process, as a training worker: a 1-rank gloo group, the real model and DeepSpeed config, 4 steps on one
# batch for ZeRO-1, 2 and 3 (ZeRO-3 also in bf16: its own optimizer class), which modules were loaded, then a Muon
# config in the same process.
MUON_PROBE = r"""
import json, sys
import torch
from raytrain.quiet import quiet_deepspeed
quiet_deepspeed()
import deepspeed
from raytrain.config import load_config
from raytrain.internals.deepspeed import STAND_IN_MARK, set_muon_aside
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
out["muon_config_set_aside"] = set_muon_aside({"optimizer": {"type": "Muon", "params": {}}})
from deepspeed.runtime.zero.muon import muon_optimizer
out["muon_real"] = not getattr(muon_optimizer, STAND_IN_MARK, False) and muon_optimizer.MuonWithAuxAdam.__module__ == muon_optimizer.__name__
print("RESULT " + json.dumps(out))
"""


def _muon_probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "RAYTRAIN_INTERNALS")}
    full.update(PYTHONPATH=str(ROOT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(29000 + os.getpid() % 1000), **env)
    proc = subprocess.run([sys.executable, "-c", MUON_PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_muon_modules_set_aside_for_every_zero_stage_and_back_for_a_muon_config():
    """Engines of every ZeRO stage train with DeepSpeed's Muon modules set aside and torch's compiler stack never
    loads; a later engine of the same process configured with Muon gets the real modules (it once got the
    stand-ins)."""
    out = _muon_probe()
    assert out["set_aside"] == [True, True, True, True], out
    for case, losses in out["losses"].items():
        assert losses[-1] < losses[0], (case, losses)  # the optimizer steps: the batch's loss falls
    assert out["compiler_loaded"] == [] and out["muon_config_set_aside"] is False and out["muon_real"], out


def test_muon_modules_are_deepspeeds_own_when_forced_stock():
    out = _muon_probe(RAYTRAIN_INTERNALS="stock")
    assert out["set_aside"] == [False] * 4 and out["compiler_loaded"], out
    assert out["muon_real"], out


def test_a_bad_value_of_the_switch_is_one_line_and_exit_2():
    env = {**os.environ, "RAYTRAIN_INTERNALS": "off"}
    out = subprocess.run([sys.executable, "-m", "raytrain", "config", "--config", "tiny"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "RAYTRAIN_INTERNALS='off' is not understood: set it to 'stock'" in out.stderr


def test_a_planned_exit_is_not_logged_as_a_workers_error_and_other_errors_are(monkeypatch):
    """An elastic run's ranks leave after a notice's checkpoint (NoticeLeave): Ray Train's "Error in training
    function" line for it is dropped, once installed however often asked; any other error is logged; with the gate
    closed nothing is dropped."""
    import logging

    from raytrain.internals import ray as rays
    from raytrain.internals import registry

    logger = logging.getLogger(rays._ERROR_LOGGER)
    monkeypatch.setattr(logger, "filters", [])
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        rays.quiet_planned_exits("NoticeLeave")
        rays.quiet_planned_exits("NoticeLeave")
        assert len(logger.filters) == 1
        logger.error("Error in training function:\nraytrain.worker.preemption.NoticeLeave: rank 0: leaving")
        logger.error("Error in training function:\nValueError: a real one")
        assert got == ["Error in training function:\nValueError: a real one"]
        logger.filters.clear()
        monkeypatch.setenv(registry.FORCE_ENV, "stock")
        monkeypatch.setattr(registry, "_WARNED", set())
        rays.quiet_planned_exits("NoticeLeave")
        assert logger.filters == []
    finally:
        logger.removeHandler(handler)
