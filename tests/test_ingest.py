"""data.reader=ray (raytrain/data/ingest.py): Ray Data reads the units the sample plan names and the ranks get them by
key: the same batches, losses and content checksums as the direct reader at 2 and 4 workers, through a 2 -> 1 -> 2
resize, Parquet and WebDataset, with a transform; the training workers read nothing from storage; the pipeline reads
each unit once (counted at the S3 server) and holds a bounded number of bytes in the object store. A SIGKILL, a lost
node, a drain and a lost data node with this reader: tests/test_chaos.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raytrain.data.ingest import items_between, rank_units
from raytrain.data.manifest import load_split
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.sample_plan import SamplePlan, lanes_of
from raytrain.errors import UserError
from tests.helpers import tiny_cfg


def _metrics(run_uri: str) -> list[dict]:
    return [json.loads(x) for x in open(f"{run_uri}/metrics.jsonl").read().splitlines()]


def _steps(run_uri: str) -> dict[int, dict]:
    recs = [r for r in _metrics(run_uri) if "loss" in r]
    assert len({r["step"] for r in recs}) == len(recs), "a step was logged twice"
    return {r["step"]: r for r in recs}


@pytest.fixture(scope="module")
def both(corpus_dir, tmp_path_factory):
    """The tests' corpus prepared as Parquet and WebDataset (the same rows in both)."""
    out = tmp_path_factory.mktemp("both") / "ds"
    prepare(PrepareConfig(inputs=[str(corpus_dir)], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0, val_fraction=0.1, formats=["parquet", "webdataset"]),
            log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def direct(reference_run):
    """The direct reader's uninterrupted 12 steps on 2 workers, Parquet: the batches the ray reader must give. The
    session's reference run: its dataset is prepared from the same corpus with the same settings as `both`, whose
    Parquet rows are the same."""
    return _steps(reference_run["run_uri"])


def _same_batches(got: dict, want: dict, from_step: int = 1) -> None:
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert (got[step]["batch_crc32"], got[step]["content_checksum"]) == \
            (want[step]["batch_crc32"], want[step]["content_checksum"]), step
        if step >= from_step:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), step


def test_items_list_each_unit_once_with_the_ranks_that_need_it(both):
    split = load_split(f"{both}/train")
    plan = SamplePlan.for_split(split, 0, 8)
    for world in (1, 2, 4):
        items = items_between(plan, world, 3, 3, 3 + 2 * plan.steps_per_epoch)
        keys = [(it["epoch"], it["unit"]) for it in items]
        assert len(keys) == len(set(keys)) and [it["step"] for it in items] == sorted(it["step"] for it in items)
        for rank in range(world):
            want = []
            for step, epoch, unit in rank_units(plan, lanes_of(8, rank, world), 3):
                if step >= 3 + 2 * plan.steps_per_epoch:
                    break
                want.append((epoch, unit))
            assert [k for k, it in zip(keys, items) if rank in it["ranks"]] == sorted(
                want, key=lambda k: keys.index(k))
            assert set(want) == {k for k, it in zip(keys, items) if rank in it["ranks"]}


def test_the_ray_reader_takes_no_mixture_yet():
    with pytest.raises(UserError, match="data.reader=ray does not take a mixture yet"):
        tiny_cfg("/nowhere", "/tmp", "x", "data.reader=ray",
                 "data.train=[{name: a, path: /a, weight: 1}, {name: b, path: /b, weight: 1}]")


@pytest.mark.slow
def test_ray_reader_on_webdataset_through_a_2_1_2_resize(ray_cluster, both, tmp_path, direct):
    """WebDataset shards, 2 workers -> 1 -> 2 with a crash after each checkpoint: the direct Parquet run's batches
    in every step, its losses from the first resume on."""
    from raytrain.trainer import train

    common = ("data.reader=ray", "data.format=webdataset", "checkpoint.every_n_steps=4", "run.max_steps=12",
              "checkpoint.upload=sync")
    with pytest.raises(Exception):
        train(tiny_cfg(both, tmp_path, "ray-resize", *common), log=lambda *_: None,
              inject={"crash_at_step": 5, "marker": str(tmp_path / "m1")})
    with pytest.raises(Exception):
        train(tiny_cfg(both, tmp_path, "ray-resize", *common, "scaling.num_workers=1"), log=lambda *_: None,
              inject={"crash_at_step": 9, "marker": str(tmp_path / "m2")})
    cfg = tiny_cfg(both, tmp_path, "ray-resize", *common)
    summary = train(cfg, log=lambda *_: None)
    _same_batches(_steps(cfg.run_uri), direct, from_step=5)
    assert summary["data_bytes_fetched_per_worker"] == 0


@pytest.fixture(scope="module")
def fim_data(corpus_dir, tmp_path_factory):
    """The corpus prepared with the fill-in-the-middle sentinels in its tokenizer."""
    out = tmp_path_factory.mktemp("fim") / "ds"
    prepare(PrepareConfig(inputs=[str(corpus_dir)], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                          near_dup_threshold=1.0, val_fraction=0.1,
                          special_tokens=["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]), log=lambda *_: None)
    return out


@pytest.mark.slow
def test_a_transform_gives_the_same_rows_with_either_reader_and_fim_trains(ray_cluster, fim_data, tmp_path):
    """data.transform=fim on 4 workers: the ray reader (the transform in its Ray Data tasks) and the direct reader
    (in the workers' read threads) train on the same bytes, step by step, to the same losses; the loss falls."""
    from raytrain.data import content_checksum
    from raytrain.data.reader import read_unit
    from raytrain.data.sample_plan import units_of
    from raytrain.data.transforms import Transform
    from raytrain.trainer import train

    runs = {}
    for reader in ("direct", "ray"):
        cfg = tiny_cfg(fim_data, tmp_path, f"fim-{reader}", f"data.reader={reader}", "data.transform=fim",
                       "data.transform_args={rate: 0.5}", "run.max_steps=10", "data.val=null",
                       "scaling.num_workers=4", "scaling.cpus_per_worker=0.5",  # CPUs left for the read tasks
                       "batch.micro_batch_size=2")  # the global batch of 8 the plan below is read with
        train(cfg, log=lambda *_: None)
        runs[reader] = _steps(cfg.run_uri)
    assert {s: (r["content_checksum"], r["loss"]) for s, r in runs["ray"].items()} == \
        {s: (r["content_checksum"], pytest.approx(r["loss"], abs=1e-5)) for s, r in runs["direct"].items()}
    loss = {s: r["loss"] for s, r in runs["ray"].items()}
    assert (loss[9] + loss[10]) / 2 < 0.9 * (loss[1] + loss[2]) / 2, loss
    # The rows trained on are transformed ones: not the checksum of the untransformed first batch.
    split = load_split(f"{fim_data}/train")
    plan = SamplePlan.for_split(split, 0, 8)
    first = plan.step(0)
    units = units_of(split.shard_rows)
    t = Transform("fim", {"rate": 0.5}, 0)
    raw = np.stack([read_unit(split, units[u], dtype=np.int32)[r] for u, r in zip(first.units, first.rows)])
    fimmed = np.stack([t(read_unit(split, units[u], dtype=np.int32), epoch=0, unit=int(u), split=split)[r]
                       for u, r in zip(first.units, first.rows)])
    assert runs["ray"][1]["content_checksum"] == content_checksum.of_batch(fimmed) != content_checksum.of_batch(raw)


def test_the_ray_reader_without_a_cpu_for_its_read_tasks_is_refused(ray_cluster, both):
    """4 workers of 1 CPU on this 4-CPU cluster, no data nodes: the read tasks would never run. On a local instance
    (nothing will add CPUs) one line saying what to change; 0.5 CPU per worker leaves them room."""
    from raytrain.trainer import check_cluster

    with pytest.raises(UserError, match=r"needs 5 CPU \(4 workers, and data.reader=ray its read tasks\).*"
                                        r"lower scaling.cpus_per_worker or set data.reader=direct"):
        check_cluster(tiny_cfg(both, "/tmp", "x", "data.reader=ray", "scaling.num_workers=4"), local=True)
    check_cluster(tiny_cfg(both, "/tmp", "x", "data.reader=ray", "scaling.num_workers=4",
                           "scaling.cpus_per_worker=0.5"), local=True)


def test_auto_takes_the_ray_reader_only_where_data_nodes_are(ray_cluster, both):
    """data.reader=auto: this test cluster has no `data` resource, so the direct reader; a mixture always direct."""
    from raytrain.trainer import reader_for

    assert reader_for(tiny_cfg(both, "/tmp", "x")) == "direct"
    assert tiny_cfg(both, "/tmp", "x").data.reader == "auto"


def _object_store_bytes() -> int:
    """Bytes of the objects some process of the cluster holds a reference to, each counted once (`ray memory`'s
    listing: objects no longer referenced, still in the store until the raylet's batched free, are not held)."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.internal_api import get_state_from_address
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    sizes = {}
    for node in get_state_from_address(ray.get_runtime_context().gcs_address).node_table():
        if node["Alive"]:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(
                init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"))
            reply = stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(include_memory_info=True), timeout=30)
            for worker in reply.core_workers_stats:
                sizes.update({o.object_id: o.object_size for o in worker.object_refs if o.object_size > 0})
    return sum(sizes.values())


@pytest.mark.parametrize("world,internals", [(1, ""), (2, "stock"), (4, "")])
def test_ingest_reads_once_and_holds_its_bound_while_the_ranks_are_slow(ray_cluster, s3_server, world, internals):
    """24 units of 131 kB on the S3 server (in the object store, not inline), 1, 2 and 4 ranks: the ranks take
    nothing for a while, then one unit at a time slowly. Each rank gets the rows of the units it asks for; the S3
    server sent each shard's bytes once (bytes, counted at the server); the bytes the ingest holds in the object
    store stay under the router's bound (queue_units units per rank queued, twice as many in Ray Data, one in hand)
    plus one unit. Both ways: the read tasks' blocks handed to the ranks (raytrain/internals), and with
    RAYTRAIN_INTERNALS=stock, Ray Data's public rows through the router."""
    import itertools
    import time

    import ray

    from raytrain.data.ingest import IngestRouter, UnitFeed
    from raytrain.data.manifest import Split
    from raytrain.data.shards import write_shard
    from tests.helpers import S3_RECORD, s3_bytes_sent

    rng = np.random.default_rng(world)
    uri = f"s3://raytrain-test/ingest-bound-{world}/train"
    data = rng.integers(0, 300, (24, 128, 257)).astype(np.int32)
    shards = [write_shard(uri, i, i * 128, data[i], ["parquet"])[0]["parquet"] for i in range(24)]
    split = Split(uri, tuple(s["uri"] for s in shards), (128,) * 24, 256, 300, 0, "", "parquet")
    gb = 8  # a step needs at most 8 units at once: within what the queues and Ray Data hold
    plan = SamplePlan.for_split(split, 0, gb)
    needs = {r: list(itertools.takewhile(lambda x: x[0] < plan.steps_per_epoch,
                                         rank_units(plan, lanes_of(gb, r, world), 0))) for r in range(world)}
    want = {r: [(e, u) for _, e, u in needs[r]] for r in range(world)}
    before, t0 = _object_store_bytes(), time.time()
    router = ray.remote(IngestRouter).options(
        num_cpus=0, max_concurrency=world + 8, runtime_env={"env_vars": {"RAYTRAIN_INTERNALS": internals}}).remote(
        split.to_dict(), seed=0, global_batch=gb, shuffle=True, world=world, start_step=0,
        end_step=plan.steps_per_epoch, queue_units=2, resources={})
    stats = ray.get(router.stats.remote())
    assert stats["unit_bytes"] == 128 * 257 * 4
    assert stats["bound_bytes"] == (3 * 2 * world + (3 if internals else 1)) * stats["unit_bytes"]
    feeds = {r: UnitFeed(router, r, bound=2, poll_s=0.5) for r in range(world)}
    got: dict[int, list] = {r: [] for r in range(world)}
    peak, t_end = 0, time.monotonic() + 60
    while ray.get(router.stats.remote())["queued"] != [2] * world and time.monotonic() < t_end:
        time.sleep(0.1)  # nobody takes a unit: the pipeline runs until it is held back
    for _ in range(20):
        peak = max(peak, _object_store_bytes() - before)
        time.sleep(0.05)
    # Then the ranks take, slowly, step by step as training does: each rank's reader asks for every unit first
    # needed at a step (one per lane at most), then waits for them.
    for step in sorted({s for n in needs.values() for s, _, _ in n}):
        asked = [(r, (e, u), feeds[r].future((e, u))) for r in range(world) for s, e, u in needs[r] if s == step]
        for r, (e, u), fut in asked:
            rows, bad = fut.result(timeout=60)
            assert bad == "" and np.array_equal(rows, data[u])  # a unit is a whole shard here
            got[r].append((e, u))
            peak = max(peak, _object_store_bytes() - before)
        time.sleep(0.2)  # slowed: objects released a moment ago are still counted (Ray frees them asynchronously)
    assert {r: sorted(g) for r, g in got.items()} == {r: sorted(w) for r, w in want.items()}
    assert ray.get(router.stats.remote())["path"] == ("router" if internals else "blocks")
    assert 0 < peak <= stats["bound_bytes"] + stats["unit_bytes"], (peak, stats)
    sent = s3_bytes_sent(S3_RECORD, t0, time.time() + 1, f"/raytrain-test/ingest-bound-{world}/train/shard-")
    assert sorted(sent) == sorted(f"/raytrain-test/ingest-bound-{world}/train/{s['path']}" for s in shards)
    assert sum(sent.values()) <= 1.1 * sum(s["bytes"] for s in shards), (sent, shards)
    for f in feeds.values():
        f.close()
    ray.kill(router)
