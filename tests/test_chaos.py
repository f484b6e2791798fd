"""Chaos on a local multi-node Ray cluster (scripts/chaos.py in a subprocess), checkpoints on the local S3 server.

Each training worker has a node of its own. The drill SIGKILLs worker processes at random steps and
removes a node once (the harness adds a spare, as an autoscaler would), then drains a node for
preemption with a deadline. The runs must train on exactly the samples, in the same order, and reach
exactly the losses of the same run without faults.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=32", "batch.micro_batch_size=4",
        "optim.lr=3e-3", "optim.warmup_steps=2", "data.eval_samples=16", "checkpoint.memory_every_n_steps=1"]


def _drill(tmp_path, *args) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_kills_a_lost_node_and_a_drain_train_on_the_same_samples_with_the_same_losses(s3_server, tiny_data, tmp_path,
                                                                                    reference_run):
    """A SIGKILL, a node lost without notice, a reclaim notice (a fake AWS metadata endpoint per node, read by the
    node's notice watcher, which drains it) and the loss of the CPU-only data node that data.reader=ray reads on, in
    one run (one cluster, one baseline): the same batches (plan ids and content checksums) and losses as the run
    without faults; the data node's loss costs no restart. run.max_failures=1 is exactly the kill: the run finishes
    only if the node lost without notice and the drain are charged to the preemption budget (run.max_preemptions=2).
    (One kill, not two: a restart costs ~30 s of the suite here, and repeated kills in one run are the recovery
    bench's, section 4b.)"""
    # Compared with the session's reference run (the same model, data, batch, 12 steps and checkpoint interval; the
    # direct reader there: both readers give the same rows, tests/test_ingest.py), not a baseline trained here.
    res = _drill(tmp_path, "--data", str(tiny_data), "--storage", "s3://raytrain-test/chaos", "--steps", "12",
                 "--every", "4", "--kills", "1", "--remove-node-at", "6", "--drain-at", "9", "--drain-deadline", "12",
                 "--notices", "--remove-data-node-at", "4", "--seed", "3", "--baseline-run", reference_run["run_uri"],
                 *TINY, "data.reader=ray", "run.max_failures=1", "run.max_preemptions=2")
    kinds = [e["signal"] for e in res["events"]]
    assert kinds.count("SIGKILL") == 1 and kinds.count("REMOVE_NODE") == 1 and kinds.count("DRAIN_NODE") == 1
    assert kinds.count("REMOVE_DATA_NODE") == 1 and [e["action"] for e in res["harness"]].count("REMOVE_DATA_NODE") == 1
    # The drain came as on a cloud VM: the node's metadata endpoint announced the reclaim and the node's notice watcher
    # drained it (no one else drains with --notices).
    drained = [log for log in res["notice_watchers"].values() if "draining this node" in log]
    assert len(drained) == 1 and "AWS spot instance-action terminate" in drained[0], res["notice_watchers"]
    assert res["summary"]["steps"] == 12 and res["summary"]["restarts"] == 3
    assert len(res["recovery"]) == 3 and all(r["resumed_from"] is not None for r in res["recovery"])
    assert sorted(map(int, res["chaos"])) == list(range(1, 13))
    assert res["same_batches"], "a sample was skipped or repeated, or other rows trained"
    assert res["max_loss_diff"] <= 1e-5
    for r in res["recovery"]:
        # A killed worker resumes from its node's memory snapshots (the tier is on by default): the step it died
        # in, or the one before. A drained node checkpoints at once: at most one step. A lost node: from its peer
        # copy (usually one step too), else from storage - at most the steps since the newest committed
        # checkpoint, up to two intervals with the async upload.
        assert 0 <= r["steps_lost"] <= (2 * 4 if r["signal"] == "REMOVE_NODE" else 1), r
