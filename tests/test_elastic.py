"""Elastic runs (scaling.num_workers: [MIN, MAX]): the usable sizes, bad ranges refused in one line, the controller's
size decisions on a cluster that changes under them, waiting below MIN and its limit (exit 3), and a real run that
loses a node, shrinks, grows back and trains every step once with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrain.config import load_config
from raytrain.elastic.sizing import Node, Sizing
from raytrain.errors import CapacityTimeout
from raytrain.trainer import train
from tests.helpers import tiny_cfg

TRAINER = {"CPU": 1.0, "trainer": 1.0}


# --- sizes --------------------------------------------------------------------------------------------------------
def test_usable_sizes_keep_the_global_batch_with_the_largest_micro_batch_that_fits():
    cfg = load_config("tiny", ["scaling.num_workers=[1,5]", "batch.global_batch_size=24", "batch.micro_batch_size=4"])
    # 5 does not divide 24: not usable. Each size: the largest micro-batch <= 4 that divides its rank's share.
    assert cfg.sizes() == {1: (4, 6), 2: (4, 3), 3: (4, 2), 4: (3, 2)}
    for n, (mb, acc) in cfg.sizes().items():
        at = cfg.at_size(n)
        assert (at.scaling.num_workers, at.batch.micro_batch_size, at.accumulation, at.global_batch) == (n, mb, acc, 24)
    tp = load_config("tiny", ["scaling.num_workers=[1,6]", "batch.global_batch_size=12", "model.family=llama",
                              "deepspeed.tensor_parallel_size=2", "batch.micro_batch_size=8"])
    assert sorted(tp.sizes()) == [2, 4, 6]  # whole tensor-parallel groups only


@pytest.mark.parametrize("overrides,says", [
    (["scaling.num_workers=[4,2]", "batch.global_batch_size=8"], "MIN is larger than MAX"),
    (["scaling.num_workers=[0,2]", "batch.global_batch_size=8"], "MIN must be >= 1"),
    (["scaling.num_workers=[2,4]"], "needs batch.global_batch_size"),
    (["scaling.num_workers=[2,4]", "batch.global_batch_size=7"], "no size in scaling.num_workers=[2, 4] keeps"),
    (["scaling.num_workers=[3,3]", "batch.global_batch_size=12", "model.family=llama",
      "deepspeed.tensor_parallel_size=2"], "must divide scaling.num_workers=3"),
    (["scaling.num_workers=[3,3]", "batch.global_batch_size=12", "model.family=llama",
      "deepspeed.tensor_parallel_size=4", "model.n_head=4", "model.intermediate_size=256"], "must divide"),
    (["scaling.num_workers=[5,7]", "batch.global_batch_size=12", "model.family=llama",
      "deepspeed.tensor_parallel_size=4", "model.n_head=4", "model.intermediate_size=256"], "divides no size"),
])
def test_a_bad_range_is_one_line_and_exit_2_before_anything_starts(tmp_path, overrides, says):
    p = subprocess.run([sys.executable, "-m", "raytrain", "train", "--config", "tiny", f"checkpoint.storage={tmp_path}",
                        *overrides], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not any(tmp_path.iterdir()), "nothing may be written before the config is accepted"


def test_raytrain_config_prints_each_size(tmp_path):
    p = subprocess.run([sys.executable, "-m", "raytrain", "config", "scaling.num_workers=[2,4]",
                        "batch.global_batch_size=24", "model.vocab_size=512"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("#    ")]
    assert [r.split("|")[0].strip("# ") for r in rows] == ["2", "3", "4"]
    assert "6 x 2" in rows[0] and "8 x 1" in rows[1] and "MiB" in rows[2]


# --- decisions ----------------------------------------------------------------------------------------------------
class Cluster:
    """A cluster the decisions look at: nodes come, go, drain, stop answering; a clock that moves by hand."""

    def __init__(self, n: int):
        self.nodes = {f"n{i}": Node(f"n{i}", dict(TRAINER), ("127.0.0.1", 1000 + i)) for i in range(n)}
        self.dead: set = set()  # alive in Ray's eyes, raylet gone (a reclaim Ray has not noticed yet)
        self.now = 1000.0
        self.events: list = []

    def sizing(self, sizes, **kw) -> Sizing:
        kw = {"monitor_s": 10.0, "grow_stable_s": 10.0, "max_wait_s": None, **kw}
        return Sizing(sizes=sizes, per_worker=TRAINER, nodes=lambda: list(self.nodes.values()),
                      reachable=lambda addr: not any(n.address == addr for n in self.nodes.values() if n.id in self.dead),
                      publish=self.events.append, clock=lambda: self.now, pause=self.tick, **kw)

    def tick(self, s: float) -> None:
        self.now += s


def test_start_at_the_largest_usable_size_the_live_nodes_hold():
    c = Cluster(4)
    s = c.sizing([1, 2, 4])  # 3 does not keep this run's global batch
    assert s.start_size() == 4
    s.started({"n0", "n1", "n2", "n3"}, 4)
    c.dead.add("n3")  # lost without notice: Ray still lists it, its raylet is gone
    assert s.lost(s.group_nodes) == {"n3"}
    assert s.start_size() == 2  # 3 nodes live, 3 is not usable
    s.started({"n0", "n1"}, 2)
    c.now += 60
    assert s.grow_size(2) is None  # n3 is still listed alive, but it was found lost: no restart onto it
    c.nodes["n2"].draining = True
    assert s.start_size() == 2
    del c.nodes["n1"]
    assert s.start_size() == 1


def test_below_min_the_run_waits_and_max_wait_for_capacity_ends_it():
    c = Cluster(1)
    s = c.sizing([2, 4], max_wait_s=30.0)
    t0 = c.now
    for _ in range(10):
        assert s.start_size() is None  # each look pauses (the controller would ask again at once)
    assert c.events[0]["event"] == "waiting" and c.events[0]["room"] == 1 and c.now > t0
    c.nodes["n9"] = Node("n9", dict(TRAINER), ("127.0.0.1", 1999))
    assert s.start_size() == 2 and c.events[-1]["event"] == "capacity_back"
    del c.nodes["n9"]
    with pytest.raises(CapacityTimeout, match="max_wait_for_capacity=30"):
        for _ in range(100):
            s.start_size()


def test_a_node_counts_toward_growing_only_once_it_stayed_grow_stable_s():
    c = Cluster(2)
    s = c.sizing([1, 2, 3, 4], monitor_s=5.0, grow_stable_s=20.0)
    assert s.start_size() == 2
    c.now += 5
    c.nodes["n8"] = Node("n8", dict(TRAINER), ("127.0.0.1", 1998))
    assert s.grow_size(2) is None  # first seen now
    c.now += 10
    assert s.grow_size(2) is None  # 10 s old
    del c.nodes["n8"]  # came and went: no restart at all
    c.now += 10
    assert s.grow_size(2) is None
    c.nodes["n9"] = Node("n9", dict(TRAINER), ("127.0.0.1", 1999))
    assert s.grow_size(2) is None  # within monitor_s of the last look: not even looked
    c.now += 5
    assert s.grow_size(2) is None  # first seen now
    c.now += 20
    assert s.grow_size(2) == 3 and c.events[-1] == {"event": "grow", "time": c.now, "from": 2, "to": 3}


def test_a_node_gone_without_notice_that_ray_still_lists_is_no_room_to_grow():
    c = Cluster(2)
    s = c.sizing([1, 2, 3], monitor_s=1.0, grow_stable_s=1.0)
    assert s.start_size() == 2
    s.started({"n0", "n1"}, 2)
    c.nodes["n5"] = Node("n5", dict(TRAINER), ("127.0.0.1", 1995))
    c.now += 1
    assert s.grow_size(2) is None  # first seen now
    c.now += 2
    c.dead.add("n5")  # gone a moment ago: Ray still lists it alive, its raylet does not answer
    assert s.grow_size(2) is None and "n5" in s.gone
    c.nodes["n6"] = Node("n6", dict(TRAINER), ("127.0.0.1", 1996))
    c.now += 1
    assert s.grow_size(2) is None
    c.now += 2
    assert s.grow_size(2) == 3  # a live one


def test_a_grow_asks_for_a_checkpoint_first_and_only_a_grow_does():
    c = Cluster(2)
    asked = []
    s = c.sizing([1, 2, 3], monitor_s=1.0, grow_stable_s=1.0, ask_checkpoint=lambda: asked.append(c.now) or 17)
    assert s.start_size() == 2
    s.before_resize()  # the first start: nothing to ask
    c.nodes["n5"] = Node("n5", dict(TRAINER), ("127.0.0.1", 1995))
    c.now += 1
    assert s.grow_size(2) is None
    c.now += 1
    assert s.grow_size(2) == 3
    s.before_resize()
    assert asked == [c.now] and c.events[-1]["event"] == "grow_checkpoint" and c.events[-1]["step"] == 17
    s.before_resize()  # a restart after a failure, say: not a grow
    assert len(asked) == 1


def test_a_node_reclaimed_with_notice_is_told_from_one_lost_without():
    """After a drain's checkpoint an elastic run's ranks leave at once (the group restarts on the nodes that stay):
    the failure that follows is a reclaim with notice, not a lost node; neither node counts again."""
    c = Cluster(3)
    s = c.sizing([1, 2, 3])
    assert s.start_size() == 3
    s.started({"n0", "n1", "n2"}, 3)
    c.nodes["n2"].draining = True
    assert s.lost(s.group_nodes) == {"n2"} and s.drained == {"n2"}
    c.nodes["n2"].draining = False  # (even were the drain cancelled, the node stays out)
    assert s.start_size() == 2
    s.started({"n0", "n1"}, 2)
    c.dead.add("n1")
    assert s.lost(s.group_nodes) == {"n1"} and s.drained == set()


# --- on a real cluster --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_waiting_below_min_ends_after_max_wait_with_exit_3_and_at_once_on_ctrl_c(ray_cluster, tiny_data, tmp_path):
    """The session cluster has 4 CPUs: a run whose MIN needs 5 workers of 1 CPU waits, then ends with its line
    (exit status 3). Submitted again without a limit, a Ctrl-C while it waits ends it within seconds (a
    KeyboardInterrupt saying the checkpoints are kept: the CLI's exit 130), not when the wait would end (Ray's
    control loop gives its event loop no turn while no group runs: the abort used to wait for capacity)."""
    import os
    import signal
    import threading
    import time

    sizes = ("scaling.num_workers=[5,6]", "batch.global_batch_size=60")
    with pytest.raises(CapacityTimeout) as err:
        train(tiny_cfg(tiny_data, tmp_path, "waits", *sizes, "run.max_wait_for_capacity=2"))
    assert err.value.exit_status == 3 and "below scaling.num_workers' MIN 5" in str(err.value)
    log = tmp_path / "waits" / "elastic.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["submitted", "waiting", "ended"] and events[1]["min"] == 5
    assert events[2]["ok"] is False and events[2]["time"] - events[1]["time"] >= 2

    sent = []

    def ctrl_c_while_waiting():  # (the run's handler is in place once the controller runs, before it waits)
        while log.read_text().count('"waiting"') < 2:
            time.sleep(0.2)
        time.sleep(0.5)
        sent.append(time.time())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_while_waiting, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="checkpoints are kept: the same command resumes it"):
        train(tiny_cfg(tiny_data, tmp_path, "waits", *sizes, "run.max_wait_for_capacity=60"))  # (bounded if not)
    assert time.time() - sent[0] < 15
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events[-3:]] == ["submitted", "waiting", "ended"] and events[-1]["ok"] is False


@pytest.mark.slow
def test_a_run_shrinks_when_a_node_is_lost_and_grows_back_with_the_losses_of_an_uninterrupted_run(s3_server, tiny_data,
                                                                                                  tmp_path,
                                                                                                  reference_run):
    """Two worker nodes (a `trainer` slot each) and scaling.num_workers=[1, 2]: a node is lost for good at step 5
    (no replacement, no notice), a node joins at step 8. The run goes 2 -> 1 -> 2 workers with run.max_failures=0
    (the lost node is a preemption, not a failure), trains every step once, on the batches of the uninterrupted
    2-worker run (the session's reference run: the same model, data, global batch and 12 steps), to its losses (1e-5).
    The shrink restores from the 2 workers' host-memory snapshots (the lost node's from its peer copy), cut for 1: at
    most one step redone, though the newest storage checkpoint is step 4. The controller's events say what happened."""
    from tests.test_chaos import TINY, _drill

    res = _drill(tmp_path, "--data", str(tiny_data), "--storage", "s3://raytrain-test/elastic", "--steps", "12",
                 "--every", "4", "--kills", "0", "--nodes", "2", "--lose-node-at", "5", "--add-node-at", "8",
                 "--add-node-hold", "8", "--baseline-run", reference_run["run_uri"], *TINY, "scaling.num_workers=[1,2]",
                 "batch.global_batch_size=8", "run.max_failures=0", "scaling.resize_monitor_s=2",
                 "scaling.grow_stable_s=2")
    assert res["summary"]["steps"] == 12
    assert sorted(map(int, res["chaos"])) == list(range(1, 13))
    assert res["same_batches"], "a sample was skipped or repeated, or other rows trained"
    assert res["max_loss_diff"] <= 1e-5
    from raytrain.rundir import ATTEMPTS, ELASTIC, GOODPUT, RESTORES, RunDir

    run = RunDir("s3://raytrain-test/elastic/chaos")
    assert [a["world_size"] for a in run.read_jsonl(ATTEMPTS)] == [2, 1, 2]
    shrink = run.read_jsonl(ATTEMPTS)[1]
    restored = [r for r in run.read_jsonl(RESTORES) if r.get("source") == "memory:resize"]
    assert restored and restored[0]["from_world"] == 2 and restored[0]["step"] >= 4, run.read_jsonl(RESTORES)
    assert shrink["resumed_step"] == restored[0]["step"]
    events = [(e["event"], e.get("workers")) for e in run.read_jsonl(ELASTIC)]
    # (A grow whose new group fails to start, on a loaded machine, is retried: "grow" may repeat.)
    assert [e for e in events if e[0] not in ("grow", "grow_checkpoint")] == [
        ("submitted", None), ("started", 2), ("lost_node", None), ("started", 1), ("started", 2), ("ended", None)], events
    assert events.index(("grow", None)) == 4, events
    # Growing redoes no step: the ranks checkpointed at their next step boundary and the new group resumed there.
    asked = [e for e in run.read_jsonl(ELASTIC) if e["event"] == "grow_checkpoint"]
    assert asked[0]["step"] is not None and asked[0]["step"] >= 8, asked
    assert run.read_jsonl(ATTEMPTS)[-1]["resumed_step"] == asked[0]["step"]
    # The ledger: every second of the wall time once, the start, the restart after the lost node and the resize apart.
    g = run.read_json(GOODPUT)
    assert abs(sum(g["seconds"].values()) - g["wall_s"]) <= 0.01 * g["wall_s"]
    # (What the ledger cannot place, the loop's own work between log windows: 0.14 s of this drill's 86 s. The storage
    # work an attempt defers past its first step - 0.7-0.8 s a restart on the S3 server here - is its first_step phase.)
    assert g["seconds"]["other"] <= 0.01 * g["wall_s"], g["seconds"]
    assert [a["kind"] for a in g["attempts"]] == ["start", "restart", "resize"]
    assert [a["world_size"] for a in g["attempts"]] == [2, 1, 2]
    assert g["seconds"]["productive"] > 0 and g["seconds"]["restart/workers"] > 0 and g["seconds"]["resize/restore"] > 0


def test_the_cli_exits_130_with_one_line_on_an_interrupted_run(monkeypatch, capsys):
    import raytrain.commands.config as command
    from raytrain.cli import main

    def interrupted(args):
        raise KeyboardInterrupt("the run's committed checkpoints are kept: the same command resumes it")

    monkeypatch.setattr(command, "run", interrupted)
    assert main(["config"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["raytrain: interrupted; the run's committed checkpoints are kept: the same command resumes it"]


def test_the_cli_exits_3_with_one_line_when_a_run_waited_too_long(monkeypatch, capsys):
    import raytrain.commands.config as command
    from raytrain.cli import main

    def waited(args):
        raise CapacityTimeout("waited 600 s (run.max_wait_for_capacity=600) with room for 1 worker(s), below "
                              "scaling.num_workers' MIN 2; the run's checkpoints are kept: submit it again when "
                              "capacity returns")

    monkeypatch.setattr(command, "run", waited)
    assert main(["config"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: error: waited 600 s"), err


def test_the_capacity_model_follows_nodes_as_the_controller_does():
    """scripts/simulate_spot.py --capacity: nodes join one at a time; a loss restarts the group smaller (one step
    redone without a notice, none with), below MIN it waits, a running group grows onto nodes that stayed
    grow_stable_s, looked for every monitor_s; a fixed size trains only while all its nodes are there."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from simulate_spot import capacity_run, node_events

    assert node_events([2, 1, 3], 10.0, 2.0, notice_every=2) == [  # the first tick's nodes are there at the start
        (0.0, 1, False), (0.0, 1, False), (10.0, -1, False), (22.0, 1, False), (24.0, 1, False)]
    cal = {"step_s": {1: 1.0, 2: 0.5}, "start_s": 10.0, "restart_s": 5.0, "resize_s": 4.0, "join_s": 0.0}
    run = lambda ticks, sizes, **kw: capacity_run(ticks, 20.0, sizes, cal, monitor_s=2.0, grow_stable_s=2.0,  # noqa: E731
                                                  notice_every=0, dt=0.25, **kw)
    assert run([2, 2], [1, 2])["steps"] == 60  # 30 s at 2 workers after a 10 s start: 60 steps
    r = run([2, 1], [1, 2])  # 10 s at 2 workers, a node lost: 1 step redone, 15 s at 1 after a 5 s restart
    assert (r["steps"], r["restarts"], r["redone"]) == (34, 1, 1.0)
    r = run([1, 2], [1, 2])  # 10 s at 1; a node joins at 20 s: grows after 2 s, 4 s without steps, 14 s at 2
    assert (r["steps"], r["resizes"]) == (10 + 2 + 28, 1)
    r = run([2, 0, 2], [1, 2])  # the outage: waits, then starts again
    assert r["waiting_s"] == 20.0 and r["restarts"] == 1 and r["steps"] == 20 - 1 + 30
    assert run([2, 1, 2], [2])["steps"] == 20 - 1 + 30  # a fixed 2: nothing while a node is missing
