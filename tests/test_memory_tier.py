"""The host-memory snapshot format and the ranks' agreement on a step, without Ray: a torn, blank or mixed generation is
never loaded, a kill in the middle of a copy leaves the other generation loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from raytrain.ckpt import snapshot
from raytrain.ckpt.restore import agree_memory


def _state(step: int, n: int = 1000) -> dict:
    return {"step": step, "opt": {"m": torch.full((n,), float(step)), "v": [torch.arange(3) + step, (torch.tensor(step),)]},
            "rng": torch.full((7,), step, dtype=torch.uint8), "empty": torch.empty(0)}


def _write(path: str, step: int, n: int = 1000) -> dict:
    skeleton, tensors = snapshot.dump_skeleton(_state(step, n))
    if not os.path.exists(path) or os.path.getsize(path) < snapshot.size_needed(skeleton, tensors):
        with open(path, "ab") as f:
            f.truncate(snapshot.size_needed(skeleton, tensors))
    return snapshot.write(path, {"step": step, "world": 2, "rank": 0}, skeleton, tensors)


def _load(path: str):
    h = snapshot.read_header(path)
    return snapshot.load(path, h) if h and snapshot.verify(path, h) else None


def test_round_trip_and_torn_or_mixed_generations_are_refused(tmp_path, monkeypatch):
    g0, g1 = str(tmp_path / "g0"), str(tmp_path / "g1")
    _write(g0, 5)
    _write(g1, 6)
    snap = _load(g1)
    assert snap.step == 6 and torch.equal(snap.state["opt"]["m"], torch.full((1000,), 6.0))
    assert torch.equal(snap.state["opt"]["v"][0], torch.arange(3) + 6) and snap.state["opt"]["v"][1][0].item() == 6
    assert snap.state["rng"].dtype == torch.uint8 and snap.state["empty"].numel() == 0

    # A copy killed half-way (here: it raises at the second tensor): the magic was zeroed first, so g1 is blank;
    # g0 still loads.
    real, calls = snapshot._as_bytes, []

    def dies(t):
        calls.append(t)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-copy")
        return real(t)

    monkeypatch.setattr(snapshot, "_as_bytes", dies)
    with pytest.raises(KeyboardInterrupt):
        _write(g1, 7)
    monkeypatch.setattr(snapshot, "_as_bytes", real)
    assert snapshot.read_header(g1) is None and _load(g1) is None
    assert _load(g0).step == 5

    # Mixed: step 8's header over data that changed afterwards (another step's bytes): the buffer crc refuses it.
    h = _write(g1, 8)
    off = h["buffers"][1]["off"]
    with open(g1, "r+b") as f:
        f.seek(off)
        f.write(torch.full((10,), 9.0).numpy().tobytes())
    assert snapshot.read_header(g1) == h and not snapshot.verify(g1, h) and snapshot.load(g1, h) is None
    # A torn commit block (the magic written, the header's crc not matching) and a blank file: refused.
    _write(g1, 10)
    with open(g1, "r+b") as f:
        f.seek(snapshot.BLOCK_SIZE - 60)
        f.write(b"\xff\xff\xff\xff")
    assert snapshot.read_header(g1) is None
    snapshot.invalidate(g0)
    assert snapshot.read_header(g0) is None and snapshot.read_header(str(tmp_path / "missing")) is None


_WRITER = """
import sys, torch
from raytrain.ckpt import snapshot
paths = sys.argv[1:3]
step = 0
while True:
    step += 1
    t = [torch.full((1 << 20,), float(step)) for _ in range(4)]
    sk, _ = snapshot.dump_skeleton({"step": step, "t": t})
    snapshot.write(paths[step % 2], {"step": step, "world": 1, "rank": 0}, sk, t)
    if step == 3:
        print("ready", flush=True)
"""


def test_kill_during_copy_never_yields_a_torn_generation(tmp_path):
    """SIGKILL a process that keeps copying 16 MiB snapshots: every generation either loads whole (every tensor
    holds its header's step) or is refused."""
    paths = [str(tmp_path / "g0"), str(tmp_path / "g1")]
    sk, t = snapshot.dump_skeleton({"step": 0, "t": [torch.zeros(1 << 20) for _ in range(4)]})
    for p in paths:
        with open(p, "ab") as f:
            f.truncate(snapshot.size_needed(sk, t) + 64)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, *paths], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.37)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    loaded = [s for s in (_load(p) for p in paths) if s is not None]
    assert loaded, "both generations refused: the older one must survive a kill of the newer one's copy"
    for s in loaded:
        assert all(torch.equal(x, torch.full((1 << 20,), float(s.step))) for x in s.state["t"]), s.step
    if len(loaded) == 2:
        assert abs(loaded[0].step - loaded[1].step) == 1


def test_ranks_agree_on_the_newest_step_any_node_holds_for_every_rank_not_below_a_committed_checkpoint():
    def node(actor, *held):  # held: (rank, step, samples, committed[, judged])
        return {"actor": actor, "held": [[r, s, p, c, f"/shm/{actor}-r{r}-s{s}", j] for r, s, p, c, j in
                                         ((*h, True) if len(h) == 4 else h for h in held)]}

    def rec(rank, n):
        return {"rank": rank, **n}

    a, b = node("A", (0, 5, 40, 4), (0, 6, 48, 4)), node("B", (1, 6, 48, None), (1, 7, 56, None))
    assert agree_memory([rec(0, a), rec(1, b)], 2) == (6, {0: [("A", "/shm/A-r0-s6")], 1: [("B", "/shm/B-r1-s6")]})
    # No common step; storage newer than every common step (the storage path).
    assert agree_memory([rec(0, node("A", (0, 5, 40, 4))), rec(1, node("B", (1, 7, 56, None)))], 2) is None
    assert agree_memory([rec(0, node("A", (0, 6, 48, 8))), rec(1, node("B", (1, 6, 48, None)))], 2) is None
    assert agree_memory([rec(0, node("A")), rec(1, node("B", (1, 3, 24, None)))], 2) is None
    # The ranks swapped nodes on the restart: each node still holds the other rank's newer generations (and its
    # own older ones, from the attempt before); the newest is taken from wherever it is, and the floor comes from
    # the newest snapshot that knew one (8), not the stale one (4).
    a = node("A", (0, 5, 40, 4), (0, 6, 48, 4), (1, 8, 64, None), (1, 9, 72, None))
    b = node("B", (1, 5, 40, None), (1, 6, 48, None), (0, 8, 64, 8), (0, 9, 72, 8))
    step, holders = agree_memory([rec(0, b), rec(1, a)], 2)
    assert step == 9 and holders == {0: [("B", "/shm/B-r0-s9")], 1: [("A", "/shm/A-r1-s9")]}
    # Ranks on one node send the same holdings: counted once. A peer copy on another node serves a lost one.
    a = node("A", (0, 9, 72, 8), (1, 9, 72, None), (2, 8, 64, None))
    assert agree_memory([rec(0, a), rec(1, a), rec(2, node("C"))], 3) is None  # ranks 0, 1 at 9; rank 2 at 8
    a["held"].append([2, 9, 72, None, "/shm/A-peer-r2", True])
    assert agree_memory([rec(0, a), rec(1, a), rec(2, node("C"))], 3) == (
        9, {0: [("A", "/shm/A-r0-s9")], 1: [("A", "/shm/A-r1-s9")], 2: [("A", "/shm/A-peer-r2")]})
    # Step 6 of two timelines (a rollback skipped a data window in between): not one state, never agreed on.
    a, b = node("A", (0, 5, 40, 4), (0, 6, 48, 4)), node("B", (1, 5, 40, None), (1, 6, 72, None))
    assert agree_memory([rec(0, a), rec(1, b)], 2)[0] == 5
    # Step 7's loss not read by any rank (killed before its verdict): the judged step 6 below it; one rank's
    # reading is enough (the loss is all-reduced).
    a, b = node("A", (0, 6, 48, 4), (0, 7, 56, 4, False)), node("B", (1, 6, 48, None), (1, 7, 56, None, False))
    assert agree_memory([rec(0, a), rec(1, b)], 2)[0] == 6
    b = node("B", (1, 6, 48, None), (1, 7, 56, None, True))
    assert agree_memory([rec(0, a), rec(1, b)], 2)[0] == 7
    assert agree_memory([rec(0, node("A", (0, 7, 56, 4, False))), rec(1, node("B", (1, 7, 56, None, False)))],
                        2) is None
    # Rank 0 committed step 10 after its snapshots at 9 and went with its node: the surviving actor was told (rank 0's
    # actor passes a commit on to every node actor of the run), so the snapshots at 9 are not taken (step 10 would
    # be redone and its committed checkpoint rewritten).
    a, b = node("A", (0, 9, 72, 8), (1, 9, 72, None)), node("B", (1, 9, 72, None))
    assert agree_memory([rec(0, a), rec(1, b)], 2)[0] == 9
    assert agree_memory([rec(0, a), rec(1, {**b, "committed": 10})], 2) is None
    assert agree_memory([rec(0, a), rec(1, {**b, "committed": 9})], 2)[0] == 9


def test_peer_copy_outlives_its_node_and_release_removes_everything(ray_cluster, tmp_path):
    """Node actors of one run (as on three nodes): a rank's generation copied to the partner is fetched from there
    after the first actor (its node) is gone, intact; a partner that went is replaced at the next copy (not 30 s
    later); a commit told to one actor reaches the others; releasing the run leaves no actor and no file."""
    import ray

    from raytrain.ckpt.snapshot_actor import NAMESPACE, NodeMemory, actor_name, file_prefix, release_run, run_actors

    run = f"file://{tmp_path}/peer-run"
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    actors = {n: ray.remote(NodeMemory).options(name=actor_name(run, n), namespace=NAMESPACE, max_concurrency=4).remote(
        file_prefix(shm, run) + f"{n}-", 0, run_uri=run, name=actor_name(run, n)) for n in ("a", "b", "c")}
    skeleton, tensors = snapshot.dump_skeleton(_state(6))
    path = ray.get(actors["a"].segment.remote(1, 0, snapshot.size_needed(skeleton, tensors)))
    snapshot.write(path, {"step": 6, "world": 2, "rank": 1, "format": 1}, skeleton, tensors)
    order = sorted(actors, key=lambda n: actor_name(run, n))
    first, partner, other = order[0], order[1], order[2]
    assert ray.get(actors[first].replicate.remote(1, path)) == 6  # to the next actor by name
    ray.kill(actors[partner])  # the partner's node is gone: this copy fails quietly, the next goes elsewhere at once
    assert ray.get(actors[first].replicate.remote(1, path)) is None
    assert ray.get(actors[first].replicate.remote(1, path)) == 6
    # A commit told to one actor (rank 0's) reaches the others: the floor of a restore rank 0's node may miss.
    ray.get(actors[first].note_committed.remote(10))
    deadline = time.time() + 30
    while ray.get(actors[other].holdings.remote(1))["committed"] != 10:
        assert time.time() < deadline, "a commit was not passed on to the run's other node actors"
        time.sleep(0.1)
    ray.kill(actors[first])  # the node is gone (its file stays: a leftover the release removes)
    assert ray.get(actors[other].fetch.remote(1, 3)) is None  # another world size's rank 1: not this one
    data = ray.get(actors[other].fetch.remote(1, 2))
    h = snapshot.header_of(data)
    assert h["step"] == 6 and snapshot.committed_bytes(path) == (6, data)
    assert release_run(run, shm) >= 1 and not run_actors(run) and not os.listdir(shm)


def test_a_host_copy_runs_beside_the_next_step_and_is_committed_before_the_optimizer_step(tmp_path, monkeypatch):
    """CPU training: `snapshot` hands the copy to a thread of its own and returns; the generation reads as invalid
    until the copy is done, `settle` (before the optimizer step) waits for it and commits it unjudged (the step's
    loss is read a step late); `judged` marks it and only then offers it to a peer; a snapshot of a step already
    judged is offered at once; a rollback's `invalidate` waits for a copy in flight and leaves it unreadable."""
    import threading
    from types import SimpleNamespace

    from raytrain.ckpt.host_snapshots import MemoryTier
    from raytrain.ckpt.state import TrainState
    from raytrain.config import load_config

    ckpt = load_config("tiny", ["data.train=/nowhere", "checkpoint.memory_every_n_steps=1"]).checkpoint
    tier = MemoryTier(ckpt, run_uri=str(tmp_path), rank=0, world=1)
    replicated = []
    tier.actor = SimpleNamespace(replicate=SimpleNamespace(remote=lambda rank, path: replicated.append(path)))

    def path(gen: int, nbytes: int) -> str:
        p = str(tmp_path / f"g{gen}")
        with open(p, "ab") as f:
            f.truncate(nbytes)
        tier._paths[gen] = p
        return p

    monkeypatch.setattr(tier, "_path", path)
    started, release = threading.Event(), threading.Event()
    real = snapshot.write_mapped

    def slow(*a, **kw):
        started.set()
        assert release.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(snapshot, "write_mapped", slow)
    module = torch.nn.Linear(4, 4)
    engine = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), lr_scheduler=None,
                             global_steps=3, global_samples=48, skipped_steps=0)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    tier.snapshot(engine, TrainState(step=3, samples_seen=48))
    assert started.wait(10)  # copying on its own thread while this one goes on
    g0 = str(tmp_path / "g0")
    assert snapshot.read_header(g0) is None and replicated == []
    release.set()
    tier.settle()
    snap = _load(g0)
    assert snap.step == 3 and replicated == [] and not snapshot.judged(g0, snap.header)
    assert all(torch.equal(snap.state["module"][k], v) for k, v in want.items())
    tier.judged(3)
    assert replicated == [g0] and snapshot.judged(g0, snapshot.read_header(g0))

    release.clear()
    started.clear()
    tier.judged(4)  # step 4's loss read before its snapshot: taken as judged
    tier.snapshot(engine, TrainState(step=4, samples_seen=64))
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    tier.invalidate()  # waits for the copy, then blanks both generations
    assert release.is_set() and snapshot.read_header(str(tmp_path / "g1")) is None and _load(g0) is None

    tier.judged(5)
    tier.snapshot(engine, TrainState(step=5, samples_seen=80))
    tier.settle()
    assert replicated == [g0, g0] and snapshot.judged(g0, _load(g0).header) and _load(g0).step == 5


def _zero12_states(flat: torch.Tensor, moment: torch.Tensor, world: int) -> dict[int, dict]:
    """What DeepSpeed's ZeRO-1/2 optimizer's state_dict holds on each of `world` ranks for one parameter group whose
    real elements are `flat` (fp32 weights) and `moment` (an Adam moment): the group padded at its end to 2 x world,
    cut into equal partitions; weights kept unpadded, the moment padded."""
    real = flat.numel()
    size = -(-real // (2 * world)) * 2
    out = {}
    for k in range(world):
        lo, hi = min(k * size, real), min((k + 1) * size, real)
        m = torch.cat([moment[lo:hi], torch.zeros(size - (hi - lo))])
        out[k] = {"single_partition_of_fp32_groups": [flat[lo:hi].clone()], "loss_scaler": "kept",
                  "base_optimizer_state": {"state": {0: {"exp_avg": m, "step": torch.tensor(7.0)}},
                                           "param_groups": [{"params": [0], "lr": 0.1}]}}
    return out


@pytest.mark.parametrize("real,old,new", [(103, 4, 3), (103, 3, 2), (10, 4, 1), (7, 2, 4), (64, 4, 2)])
def test_a_zero12_partition_is_cut_for_another_size_from_the_old_ranks_that_overlap_it(monkeypatch, real, old, new):
    """An elastic run that shrank restores from the snapshots of the size before: each new rank reads only the old
    ranks whose partitions overlap its own and gets exactly the weights and optimizer moments DeepSpeed would have
    partitioned to it at the new size (zeros where its partition runs past the real elements); the lr schedule's
    non-partitioned state (`step`) is carried."""
    import torch.distributed as dist

    from raytrain.internals import deepspeed as ds

    flat, moment = torch.arange(real, dtype=torch.float32), torch.arange(real, dtype=torch.float32) * -2
    states = _zero12_states(flat, moment, old)
    new_states = _zero12_states(flat, moment, new)
    size = -(-real // (2 * new)) * 2

    class DeepSpeedZeroOptimizer:  # DeepSpeed's ZeRO-1/2 optimizer as the new engine holds it (the attributes read)
        nccl_start_alignment_factor = 2
        real_dp_process_group = [None]
        round_robin_bit16_meta = [[torch.zeros(real - 3, device="meta"), torch.zeros(2, device="meta")]]
        round_robin_bit16_padding = [[1, 0]]  # a parameter's alignment padding counts as real elements
        single_partition_of_fp32_groups = [torch.zeros(size)]
        groups_padding, partition_count = [0], [new]

    for j in range(new):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, j=j: j)
        need = ds.zero_reshard_sources(DeepSpeedZeroOptimizer(), old)
        assert len(need) <= -(-old // new) + 1, need  # its share and at most one more
        got = ds.zero_reshard(DeepSpeedZeroOptimizer(), {k: states[k] for k in need}, old)
        want = new_states[j]
        assert torch.equal(got["single_partition_of_fp32_groups"][0], want["single_partition_of_fp32_groups"][0])
        g, w = got["base_optimizer_state"]["state"][0], want["base_optimizer_state"]["state"][0]
        assert torch.equal(g["exp_avg"], w["exp_avg"]) and g["step"] == 7 and got["loss_scaler"] == "kept"
        assert got["partition_count"] == [new]
    with pytest.raises(ValueError, match="was not read"):
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        ds.zero_reshard(DeepSpeedZeroOptimizer(), {old - 1: states[old - 1]}, old)


def test_ranks_agree_on_the_newest_step_of_any_size_and_prefer_their_own_on_a_tie():
    from raytrain.ckpt.restore import newest_memory_point

    def held(actor, *entries):  # (rank, step, world)
        return {"actor": actor, "held": [[r, s, s * 8, None, f"/shm/{actor}-r{r}-w{w}-s{s}", True, w]
                                         for r, s, w in entries]}

    # Four workers wrote step 6 (rank 3's from its peer copy on node B), three workers step 5 after a shrink: 6.
    a, b = held("A", (0, 6, 4), (1, 6, 4), (0, 5, 3)), held("B", (2, 6, 4), (3, 6, 4), (1, 5, 3), (2, 5, 3))
    step, holders, world, samples = newest_memory_point([{"rank": 0, **a}, {"rank": 1, **b}, {"rank": 2, **b}], 3)
    assert (step, world, samples) == (6, 4, 48) and sorted(holders) == [0, 1, 2, 3]
    # Rank 3's snapshot of step 6 is gone with its node: no complete step of 4 workers; this size's step 5.
    b = held("B", (2, 6, 4), (1, 5, 3), (2, 5, 3))
    assert newest_memory_point([{"rank": 0, **a}, {"rank": 1, **b}, {"rank": 2, **b}], 3)[:3:2] == (5, 3)
    # A storage checkpoint newer than every snapshot of any size: none.
    b["committed"] = 7
    assert newest_memory_point([{"rank": 0, **a}, {"rank": 1, **b}, {"rank": 2, **b}], 3) is None
