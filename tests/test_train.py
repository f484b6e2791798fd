"""End-to-end training on a real local Ray cluster with real DeepSpeed (CPU, gloo), tiny sizes.

Covers: a 2-worker ZeRO-2 run whose loss falls; a two-source data mixture (shares, per-source validation);
a crashed worker (on the mixture) restarted by FailureConfig from the
latest checkpoint; the same run submitted again after a failure; checkpoints and data on a local
S3-protocol server. Resumed runs must reproduce the uninterrupted run's losses within 1e-5.
"""

import json

import pyarrow.fs as pafs
import pytest

from raytrain import cost, storage
from raytrain.ckpt.layout import dir_name
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.rundir import ATTEMPTS, RunDir
from raytrain.trainer import train
from raytrain.worker.runlog import HEARTBEAT_S
from tests.helpers import assert_traced, S3_RECORD, s3_requests, tiny_cfg

pytestmark = pytest.mark.slow


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(storage.join(run_uri, "metrics.jsonl")).splitlines()]


def _crcs(run_uri: str) -> dict[int, tuple[int, int]]:
    """Per step, the fingerprint of the global batch trained on (the plan's sample ids) and the checksum of its rows
    as read: equal maps = the same samples in order, the same bytes."""
    return {r["step"]: (r["batch_crc32"], r["content_checksum"]) for r in _metrics(run_uri) if "loss" in r}


def _losses(run_uri: str) -> dict[int, float]:
    recs = [r for r in _metrics(run_uri) if "loss" in r]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def _assert_losses_of_all_12_steps_equal(run_uri: str, want: dict[int, float]) -> None:
    got = _losses(run_uri)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


@pytest.fixture(scope="module")
def baseline(reference_run):
    """The session's uninterrupted 12-step run, checkpointing every 4 steps (conftest.reference_run)."""
    return reference_run, _losses(reference_run["run_uri"])


@pytest.fixture(scope="module")
def mix_data(tiny_data, tmp_path_factory):
    """A second, smaller source (another corpus, tiny_data's tokenizer), and the two as a 0.8 / 0.2 mixture
    whose weights change at step 6, each with its own validation split."""
    from tests.helpers import synthetic_docs

    d = tmp_path_factory.mktemp("mix")
    (d / "corpus").mkdir()
    for i, doc in enumerate(synthetic_docs(30, seed=7)):
        (d / "corpus" / f"doc{i:04d}.txt").write_text(doc)
    prepare(PrepareConfig(inputs=[str(d / "corpus")], out=str(d / "small"), tokenizer=str(tiny_data / "tokenizer.json"),
                          seq_len=32, shard_rows=16, near_dup_threshold=1.0, val_fraction=0.2), log=lambda *_: None)
    return (f"data.train=[{{name: big, path: {tiny_data}/train, weight: 0.8, val: {tiny_data}/val}}, "
            f"{{name: small, path: {d}/small/train, weight: 0.2, val: {d}/small/val}}]",
            "data.mixture_schedule=[{start_step: 6, weights: {big: 0.5, small: 0.5}}]", "data.val=null")


@pytest.fixture(scope="module")
def mix_baseline(ray_cluster, tiny_data, mix_data, tmp_path_factory):
    """An uninterrupted 12-step run on the mixture, checkpointing every 4 steps."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = tiny_cfg(tiny_data, runs, "mix-baseline", "run.max_steps=12", "checkpoint.every_n_steps=4", *mix_data)
    summary = train(cfg, log=lambda *_: None)
    return summary, _losses(cfg.run_uri)


def test_mixture_run_shares_within_the_bound_validation_per_source_and_report(mix_baseline, tiny_data):
    """2 workers, sources of 248 and 54 sequences at 0.8 / 0.2, then 0.5 / 0.5 from step 6: the run's own
    per-source token counters give every window's share within the plan's stated bound."""
    from raytrain.data.mixture import bound_slots
    from raytrain.run_report import report as run_report

    summary, _ = mix_baseline
    run_uri = summary["run_uri"]
    recs = [r for r in _metrics(run_uri) if "loss" in r]
    seq, gb = 32, 8
    slots = {n: [0] + [r[f"tokens_seen/{n}"] // seq for r in recs] for n in ("big", "small")}
    assert [slots["big"][k] + slots["small"][k] for k in range(13)] == [gb * k for k in range(13)]
    for a, b, w in ((0, 6, 0.8), (6, 12, 0.5)):  # every window inside each stage
        for t0 in range(a, b):
            for t1 in range(t0 + 1, b + 1):
                got = slots["big"][t1] - slots["big"][t0]
                assert abs(got - (t1 - t0) * gb * w) <= bound_slots(t1 - t0), (t0, t1, got)
    assert summary["share/big"] == pytest.approx(slots["big"][12] / 96)
    assert summary["epochs/small"] == pytest.approx(slots["small"][12] / 54)
    first, last = [r for r in _metrics(run_uri) if "val_loss" in r][0], [r for r in _metrics(run_uri) if "val_loss" in r][-1]
    for n in ("big", "small"):
        assert last[f"val_loss/{n}"] < first[f"val_loss/{n}"] and last[f"val_ppl/{n}"] > 1
    recorded = [json.loads(x) for x in storage.read_text(storage.join(run_uri, "mixture.jsonl")).splitlines()]
    assert [r["from_step"] for r in recorded] == [0] and recorded[0]["stages"] == [[0, [0.8, 0.2]], [6, [0.5, 0.5]]]
    _, md = run_report(run_uri)
    text = storage.read_text(md)
    assert "## Data mixture" in text and "| small |" in text


def test_two_worker_zero2_loss_falls_and_checkpoints_hold_every_rank(baseline):
    """The uninterrupted 2-worker ZeRO-2 run the resume tests compare with (its loss falling far is the demo's
    test): the loss falls, and the final checkpoint holds the model once and each rank's own partition and RNG."""
    summary, losses = baseline
    assert summary["steps"] == 12 and sorted(losses) == list(range(1, 13))
    assert sum(losses[s] for s in range(10, 13)) / 3 < 0.9 * losses[1], losses
    assert summary["val_ppl"] < summary["initial_val_ppl"], summary
    run = summary["run_uri"]
    ckpt = f"{run}/checkpoint_00000012"
    assert storage.exists(f"{ckpt}/raytrain_state.json") and storage.exists(f"{ckpt}/config.yaml")
    assert storage.list_dir(f"{ckpt}/engine") == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert storage.list_dir(f"{ckpt}/rng") == ["rank_00000.pt", "rank_00001.pt"]
    state = json.loads(storage.read_text(f"{ckpt}/raytrain_state.json"))
    assert state["step"] == 12 and state["samples_seen"] == 12 * state["global_batch"]
    assert storage.exists(f"{run}/summary.json") and storage.exists(f"{run}/config.yaml")
    # The first step's memory, measured against what was planned for it (on CPU: the process's resident memory,
    # which also holds the runtime the plan leaves out).
    mem = RunDir(run).read_jsonl(ATTEMPTS)[0]["first_step_memory"]
    assert mem["device"] == "host" and mem["measured_gib"] > mem["planned_gib"] > 0, mem


def test_crashed_worker_resumes_with_identical_losses(ray_cluster, tiny_data, tmp_path, mix_data, mix_baseline):
    """SIGKILL of a worker at step 6, on the mixture (its weights change at step 6 too)."""
    _, want = mix_baseline
    cfg = tiny_cfg(tiny_data, tmp_path, "crash", "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "run.max_failures=1", "checkpoint.memory=true", *mix_data)
    summary = train(cfg, log=lambda *_: None,
                    inject={"crash_at_step": 6, "marker": str(tmp_path / "crashed"), "rank": 1})
    assert (tmp_path / "crashed").exists(), "the fault was not injected"
    assert summary["restarts"] == 1
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)
    assert _crcs(cfg.run_uri) == _crcs(mix_baseline[0]["run_uri"])
    # Restored from host memory: the newest step both ranks' node snapshots hold (rank 1 died right after step 6's
    # optimizer step, before its copy), not storage's checkpoint 4; recorded in restores.jsonl.
    (rec,) = [json.loads(x) for x in storage.read_text(cfg.run_uri + "/restores.jsonl").splitlines()]
    assert rec["source"] == "memory:local" and rec["step"] == 5 and rec["ok"], rec
    # The work thrown away, from the failed attempt's heartbeat: the one step past the snapshot up to the crash
    # at 6, plus at most the steps that fit between two heartbeat writes (0.02 s on local storage).
    report = cost.report(cfg.run_uri, cost.Prices(1.0, 1.0, 1.0))
    (restart,) = report["restarts"]
    assert restart["resumed_step"] == 5 and restart["lost_steps_from"] == "heartbeat"
    unrecorded = int(HEARTBEAT_S["local"] / report["step_s"])
    lost = 6 - restart["resumed_step"]  # (-1 below: step 6's own write may not have landed before the kill)
    assert lost - 1 <= restart["lost_steps"] <= lost + unrecorded, (restart, report["step_s"])
    # `raytrain report` lists the restart with the step it resumed at, the steps it redid and where it restored from.
    from raytrain.run_report import report as run_report

    _, md = run_report(cfg.run_uri)
    assert f"| 1 | {restart['resumed_step']} | {restart['lost_steps']} |" in storage.read_text(md)
    assert "| memory:local |" in storage.read_text(md)
    # Clean-up: the run's node actors and shared-memory files are gone once it finished.
    _assert_memory_released(cfg)


def _assert_memory_released(cfg) -> None:
    import glob

    import ray

    from raytrain.ckpt.snapshot_actor import NAMESPACE, actor_name, file_prefix

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]
    assert not [n for n in names if n.startswith(actor_name(cfg.run_uri, ""))], names
    assert not glob.glob(file_prefix(cfg.checkpoint.memory_dir, cfg.run_uri) + "*")


def test_zero3_killed_worker_resumes_from_host_memory_with_identical_losses(ray_cluster, s3_server, tiny_data,
                                                                          tmp_path):
    """ZeRO-3 (weights partitioned too) and no storage checkpoint to fall back on: rank 0 SIGKILLed right after
    step 5's optimizer step resumes from the node's memory snapshots of step 4, loss for loss and batch for batch
    with an uninterrupted ZeRO-3 run (snapshots off there: the cost of the tier shows as its stall). The run
    directory is on the S3 server, which sees no request from the kill to the first resumed step."""
    common = ("run.max_steps=8", "checkpoint.every_n_steps=100", "checkpoint.save_final=false", "deepspeed.zero_stage=3")
    ref = tiny_cfg(tiny_data, tmp_path, "z3ref", *common, "checkpoint.memory=false")
    train(ref, log=lambda *_: None)
    # (The driver's live goodput ledger off: it reads the run's JSONL files every minute, off the restart's path, and
    # its reads look like a restart's in the server's log.)
    cfg = tiny_cfg(tiny_data, "s3://raytrain-test/runs", "z3mem", *common, "run.max_failures=1", "checkpoint.memory=true",
                   "metrics.goodput_every_s=0")
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 5, "marker": str(tmp_path / "died"), "rank": 0})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    (rec,) = [json.loads(x) for x in storage.read_text(cfg.run_uri + "/restores.jsonl").splitlines()]
    assert rec["source"] == "memory:local" and rec["step"] == 4, rec
    # The object store is out of the critical path: every record start-up needs came with the snapshot, and what
    # it writes (restores.jsonl, attempts.jsonl, the heartbeat) waits for the first step.
    killed = float((tmp_path / "died").read_text())
    resumed = RunDir(cfg.run_uri).read_jsonl(ATTEMPTS)[-1]
    assert resumed["resumed_step"] == 4 and resumed["first_step_time"] - killed > 1, resumed
    # In that window only two writers outside the restart may touch the run directory: the dying attempt's surviving
    # rank filing its diagnosis of the collective it waits in, and the driver's node-time record (every 5 s).
    window = s3_requests(S3_RECORD, killed, resumed["first_step_time"])
    outside = {f"/raytrain-test/runs/z3mem/{name}" for name in ("comm_failure.txt", "nodes.json")}
    assert [r for r in window if r.split(" ")[2] not in outside] == [], window
    # The controller's side of the restart is in the attempt's line: fault seen, group torn down, new group up.
    ctl = resumed["controller"]
    assert killed < ctl["fault_detected"] <= ctl["group_torn_down"] <= ctl["group_up"] <= resumed["first_step_time"], ctl
    got, want = _losses(cfg.run_uri), _losses(ref.run_uri)
    assert sorted(got) == list(range(1, 9)) and got == want  # exactly: the same fp32 arithmetic
    assert _crcs(cfg.run_uri) == _crcs(ref.run_uri)
    stalls = [r["snapshot_stall_s"] for r in _metrics(cfg.run_uri) if "snapshot_stall_s" in r]
    # The stall of the snapshot before each record, every step but an attempt's first (none before it yet).
    assert len(stalls) >= 6 and all(0 < s < 5 for s in stalls), stalls
    assert not any("snapshot_stall_s" in r for r in _metrics(ref.run_uri))
    _assert_memory_released(cfg)


def test_resubmitted_run_on_s3_skips_a_corrupt_newest_checkpoint(ray_cluster, s3_server, corpus_dir, tmp_path,
                                                                 baseline):
    """Data and checkpoints on the local S3 server; the first job dies at step 9, after checkpoint 8 committed. A byte
    flipped in place in checkpoint 8 (same size, so only its sha256 tells): the same run submitted again skips it,
    resumes from checkpoint 4 and still matches the uninterrupted run."""
    _, want = baseline
    data = "s3://raytrain-test/data/synthetic"
    prepare(PrepareConfig(inputs=[str(corpus_dir)], out=data, vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0,
                          val_fraction=0.1), log=lambda *_: None)
    runs = "s3://raytrain-test/runs"
    # Sync upload: checkpoint 8 must be committed before the crash a step later, however loaded the machine.
    cfg = tiny_cfg(data, runs, "resubmit", "run.max_steps=12", "checkpoint.every_n_steps=4", "checkpoint.upload=sync",
                   f"checkpoint.local_dir={tmp_path / 'node'}")
    with pytest.raises(Exception):
        train(cfg, log=lambda *_: None, inject={"crash_at_step": 9, "marker": str(tmp_path / "crashed")})
    fs, base = storage.resolve(runs + "/resubmit")
    names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(base))]
    assert {"checkpoint_00000004", "checkpoint_00000008"} <= set(names) and "summary.json" not in names
    # Rank 1's optimizer partition: only rank 1 reads it, so only rank 1 can see the damage.
    rel = "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard = runs + "/resubmit/checkpoint_00000008/" + rel
    damaged = bytearray(storage.read_bytes(shard))
    damaged[len(damaged) // 2] ^= 0xFF
    storage.write_bytes(shard, bytes(damaged))
    summary = train(cfg, log=lambda *_: None)
    assert summary["checkpoint"] == runs + "/resubmit/checkpoint_00000012"
    attempts = [json.loads(x) for x in storage.read_text(runs + "/resubmit/attempts.jsonl").splitlines()]
    assert [a["resumed_step"] for a in attempts] == [0, 4]
    # Detected by rank 1 alone; both ranks moved on together to checkpoint 4 (one all-gather decides).
    restores = [json.loads(x) for x in storage.read_text(runs + "/resubmit/restores.jsonl").splitlines()]
    assert [(r["checkpoint"], r["ok"]) for r in restores] == [("checkpoint_00000008", False), ("checkpoint_00000004", True)]
    assert [r["bad"] for r in restores[0]["ranks"]] == [[], [rel]]
    # Restore: each rank read only its own partitions and the shared files, each file downloaded once per node
    # (both workers share this node), sha256-checked as it streamed in; the staging is gone afterwards.
    rec = restores[1]
    manifest = json.loads(storage.read_text(runs + "/resubmit/checkpoint_00000004/manifest.json"))["files"]
    total = sum(f["size"] for f in manifest.values())
    partition = {r: sum(f["size"] for k, f in manifest.items() if f"rank_{r}_" in k or k.endswith(f"rank_0000{r}.pt"))
                 for r in (0, 1)}
    for r in rec["ranks"]:
        assert r["reads"] == total - partition[1 - r["rank"]]  # ZeRO-2: all but the other rank's partition
    assert sum(rec["node_bytes"].values()) == total == rec["checkpoint_bytes"]  # one node: the union, once
    assert not list((tmp_path / "node" / "restore").iterdir())
    got = _losses(cfg.run_uri)
    assert sorted(got) == list(range(1, 13))
    for step in range(5, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


def test_resize_2_to_1_to_2_keeps_data_position_and_global_batch(ray_cluster, tiny_data, tmp_path, mix_data,
                                                                mix_baseline):
    """Elastic resume: the engine state is resharded, accumulation adjusted, the sample stream continues
    (a two-source mixture, whose lanes do not depend on the worker count either)."""
    _, want = mix_baseline
    # Same LR schedule as the baseline. Sync upload: each crash comes one step after a checkpoint, and on
    # a quiet machine an async upload of it may not have committed by then (the run would restart at 0).
    common = ("checkpoint.every_n_steps=4", "run.max_steps=12", "checkpoint.upload=sync", *mix_data)
    # Each segment dies one step after a checkpoint (the injected crash), like a lost node.
    with pytest.raises(Exception):
        train(tiny_cfg(tiny_data, tmp_path, "resize", *common), log=lambda *_: None,
              inject={"crash_at_step": 5, "marker": str(tmp_path / "m1")})
    one = tiny_cfg(tiny_data, tmp_path, "resize", *common, "scaling.num_workers=1")
    with pytest.raises(Exception):  # 1 worker: accumulation 1 -> 2 keeps 8 sequences per step; dies after step 8
        train(one, log=lambda *_: None, inject={"crash_at_step": 9, "marker": str(tmp_path / "m2")})
    two = tiny_cfg(tiny_data, tmp_path, "resize", *common)
    summary = train(two, log=lambda *_: None)
    got = _losses(two.run_uri)
    assert sorted(got) == list(range(1, 13)) and summary["steps"] == 12
    # Same samples in the same steps, same optimizer state: the uninterrupted run's losses.
    for step in range(5, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    for step in (8, 12):
        state = json.loads((tmp_path / "resize" / dir_name(step) / "raytrain_state.json").read_text())
        assert state["samples_seen"] == step * 8 and state["global_batch"] == 8
    assert _crcs(two.run_uri) == _crcs(mix_baseline[0]["run_uri"])
    # The audit records of the three submissions, the two resumes and both resizes, none lost.
    from raytrain import audit

    events = [(e["kind"], e.get("step"), e.get("to_world_size")) for e in audit.read(audit.run_root(two.run_uri))]
    assert [k for k, _, _ in events] == ["submit", "submit", "resume", "resize", "submit", "resume", "resize"], events
    assert [(s, w) for k, s, w in events if k == "resize"] == [(4, 1), (8, 2)]
    # Traceable across the kills, the resizes and the schedule's change at step 6: each batch's documents from
    # both sources, token for token, with the checksum each step logged (steps 6-8 were trained by one worker).
    traced = assert_traced(two.run_uri, [3, 6, 8, 12])
    assert {r["source_name"] for r in traced[6]["rows"]} == {"big", "small"}
    assert [traced[s]["world_size"] for s in (3, 6, 12)] == [2, 1, 2]
    # One universal conversion per source checkpoint (4: written by 2 workers, resumed on 1; 8: written by 1,
    # resumed on 2), each kept beside its checkpoint in storage.
    conv = [json.loads(x) for x in (tmp_path / "resize" / "conversions.jsonl").read_text().splitlines()]
    assert [(c["checkpoint"], c["from_world"], c["to_world"]) for c in conv] == [
        ("checkpoint_00000004", 2, 1), ("checkpoint_00000008", 1, 2)]
    restores = [json.loads(x)["checkpoint"] for x in (tmp_path / "resize" / "restores.jsonl").read_text().splitlines()]
    assert restores == ["checkpoint_00000004", "checkpoint_00000008"]
    assert (tmp_path / "resize" / "checkpoint_00000008" / "universal" / "manifest.json").exists()  # (4: pruned, keep_last 2)


def test_sigterm_checkpoints_at_once_and_resumes_identically(ray_cluster, tiny_data, tmp_path, baseline):
    """A worker gets SIGTERM at step 7 (no periodic checkpoint near): every rank checkpoints at that step
    or the next, the signalled worker then exits, and the run resumes there - no step lost."""
    _, want = baseline
    cfg = tiny_cfg(tiny_data, tmp_path, "sigterm", "run.max_steps=12", "checkpoint.every_n_steps=100",
                   "run.max_failures=1")
    summary = train(cfg, log=lambda *_: None, inject={"events": [{"step": 7, "rank": 1, "signal": "SIGTERM"}],
                                                      "marker": str(tmp_path / "term")})
    assert (tmp_path / "term.0").exists(), "the signal was not sent"
    noticed = [r["step"] for r in _metrics(cfg.run_uri) if r.get("preemption_checkpoint")]
    assert noticed and noticed[0] in (7, 8), noticed
    attempts = [json.loads(x) for x in (tmp_path / "sigterm" / "attempts.jsonl").read_text().splitlines()]
    assert [a["resumed_step"] for a in attempts] == [0, noticed[0]]  # resumed exactly where the notice saved
    assert summary["restarts"] == 1 and summary["steps"] == 12
    # The preemption survived is counted from its step on, through the restart (the checkpoint carries it).
    counted = {r["step"]: r["preemptions"] for r in _metrics(cfg.run_uri) if "loss" in r}
    assert all(n == (1 if step >= noticed[0] else 0) for step, n in counted.items()), counted
    assert summary["preemptions"] == 1
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)
    assert _crcs(cfg.run_uri) == _crcs(baseline[0]["run_uri"])


def test_workers_taking_every_cpu_still_get_their_data(ray_cluster, tiny_data, tmp_path):
    """4 logical CPUs, 2 workers x 2 CPUs: nothing left for Ray Data tasks. Training reads under the sample
    plan inside each worker (no Ray Data, so nothing to starve): the run trains (it once stalled here)."""
    cfg = tiny_cfg(tiny_data, tmp_path, "starved", "scaling.cpus_per_worker=2", "data.stall_timeout_s=20",
                   "run.max_steps=3", "checkpoint.every_n_steps=1000", "checkpoint.save_final=false")
    assert train(cfg, log=lambda *_: None)["steps"] == 3


def test_every_internals_gate_closed_a_run_still_survives_a_preemption_and_a_kill_and_exports(
        ray_cluster, tiny_data, tmp_path, baseline, monkeypatch):
    """RAYTRAIN_INTERNALS=stock closes every gate of raytrain/internals, as an upgraded Ray or DeepSpeed would: a
    SIGTERM at step 3 still checkpoints at once, a SIGKILL at step 6 resumes from storage (memory snapshots off:
    they rest on ZeRO's internals), the losses equal the uninterrupted run's, restart phases are not recorded, and
    the final checkpoint exports."""
    from raytrain.export import export
    from raytrain.internals.registry import FORCE_ENV

    _, want = baseline
    monkeypatch.setenv(FORCE_ENV, "stock")  # the driver's; trainer.PROPAGATED_ENV carries it to the workers
    cfg = tiny_cfg(tiny_data, tmp_path, "stock", "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "checkpoint.upload=sync", "run.max_failures=2", "run.max_preemptions=1", "checkpoint.memory=true")
    summary = train(cfg, log=lambda *_: None, inject={
        "events": [{"step": 3, "rank": 1, "signal": "SIGTERM"}, {"step": 6, "rank": 0, "signal": "SIGKILL"}],
        "marker": str(tmp_path / "fault")})
    assert (tmp_path / "fault.0").exists() and (tmp_path / "fault.1").exists()
    assert summary["restarts"] == 2 and summary["preemptions"] == 1 and summary["steps"] == 12
    noticed = [r["step"] for r in _metrics(cfg.run_uri) if r.get("preemption_checkpoint")]
    assert noticed and noticed[0] in (3, 4), noticed
    restores = RunDir(cfg.run_uri).read_jsonl("restores.jsonl")
    assert [(r["source"], r["checkpoint"]) for r in restores] == [("storage", dir_name(noticed[0])),
                                                                  ("storage", dir_name(4))], restores
    assert not any("snapshot_stall_s" in r for r in _metrics(cfg.run_uri))  # memory tier off
    assert not any("controller" in a for a in RunDir(cfg.run_uri).read_jsonl(ATTEMPTS))  # phases not recorded
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)
    out = export(f"{cfg.run_uri}/{dir_name(12)}", str(tmp_path / "model"), log=lambda *_: None)
    assert (tmp_path / "model" / "config.json").exists(), out


def test_a_snapshot_one_rank_cannot_apply_sends_every_rank_to_storage(ray_cluster, tiny_data, tmp_path, baseline):
    """Rank 1 fails inside the restore's check of its memory snapshot (injected): the ranks' vote, taken before
    any collective, sends every rank to storage's checkpoint 4; the run goes on with the uninterrupted losses and a
    single restart (no rank waited in a collective), and restores.jsonl says why."""
    _, want = baseline
    cfg = tiny_cfg(tiny_data, tmp_path, "refused", "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "checkpoint.upload=sync", "run.max_failures=1", "checkpoint.memory=true")
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 6, "rank": 0, "marker": str(tmp_path / "died"),
                                                      "memory_apply_fails": 1})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    refused, restored = RunDir(cfg.run_uri).read_jsonl("restores.jsonl")
    assert refused["source"] == "memory" and not refused["ok"] and refused["step"] == 5, refused
    assert refused["reason"] == "rank 1: RuntimeError: injected: rank 1 cannot apply its memory snapshot", refused
    assert restored["source"] == "storage" and restored["checkpoint"] == dir_name(4) and restored["ok"], restored
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)


def test_a_snapshot_one_rank_cannot_fetch_sends_every_rank_to_storage(ray_cluster, tiny_data, tmp_path, baseline):
    """Rank 1's memory snapshot must come from another node and none sends it (injected): the failed fetch is rank
    1's reason in the ranks' vote, not an exception while rank 0 goes on into the engine's collectives; every rank
    restores storage's checkpoint 4 in the same attempt (one restart: no rank waited in a collective until the
    group was torn down), restores.jsonl names the reason, and the losses are the uninterrupted run's."""
    _, want = baseline
    cfg = tiny_cfg(tiny_data, tmp_path, "unfetched", "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "checkpoint.upload=sync", "run.max_failures=1", "checkpoint.memory=true",
                   "scaling.collective_timeout_s=90")
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 6, "rank": 0, "marker": str(tmp_path / "died"),
                                                      "memory_fetch_fails": 1})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    refused, restored = RunDir(cfg.run_uri).read_jsonl("restores.jsonl")
    assert refused["source"] == "memory" and not refused["ok"] and refused["step"] == 5, refused
    assert refused["reason"] == ("rank 1: RuntimeError: no node sent this rank's memory snapshot of step 5 within "
                                 "checkpoint.memory_fetch_timeout_s=60"), refused
    assert restored["source"] == "storage" and restored["checkpoint"] == dir_name(4) and restored["ok"], restored
    # From the kill to the first resumed step: well inside the collective timeout, which no rank reached.
    (attempt,) = [a for a in RunDir(cfg.run_uri).read_jsonl(ATTEMPTS) if a.get("resumed_step")]
    assert attempt["first_step_time"] - float((tmp_path / "died").read_text()) < 60, attempt
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)


def test_auto_snapshot_interval_widens_for_a_slow_copy_and_a_kill_redoes_at_most_it_plus_one(
        ray_cluster, tiny_data, tmp_path, baseline):
    """`checkpoint.memory_every_n_steps=auto` with every snapshot stalling 50 ms more (a slow copy, injected) on
    steps of tens of ms: snapshots every other step while steps 1-8 measure (and at the storage checkpoints of steps
    4 and 8), then, agreed at step 9, as wide as allowed: 4, a storage checkpoint every 4 steps snapshots anyway.
    Rank 1 killed at step 11 resumes from the snapshot of step 8 (every step's snapshots would have held 10): 3
    steps redone, at most the interval + 1, and the losses are the uninterrupted run's."""
    _, want = baseline
    cfg = tiny_cfg(tiny_data, tmp_path, "autosnap", "run.max_steps=12", "checkpoint.every_n_steps=4",
                   "run.max_failures=1", "checkpoint.memory=true", "checkpoint.memory_every_n_steps=auto")
    summary = train(cfg, log=lambda *_: None, inject={"crash_at_step": 11, "rank": 1, "marker": str(tmp_path / "died"),
                                                      "snapshot_delay_s": 0.05})
    assert (tmp_path / "died").exists() and summary["restarts"] == 1
    stalls = {r["step"]: r["snapshot_stall_s"] for r in _metrics(cfg.run_uri) if "snapshot_stall_s" in r}
    # (Each line carries the newest snapshot's stall: every step but an attempt's first, 1 and 9, has one.)
    assert set(range(2, 13)) - {9} <= set(stalls) and all(s >= 0.05 for s in stalls.values()), stalls
    (rec,) = RunDir(cfg.run_uri).read_jsonl("restores.jsonl")
    assert rec["source"] == "memory:local" and rec["step"] == 8, rec
    assert 11 - rec["step"] <= 4 + 1
    _assert_losses_of_all_12_steps_equal(cfg.run_uri, want)
