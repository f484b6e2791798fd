"""Reading under the sample plan: each rank reads only its units, each once; batches equal at 1, 2 and 4 workers."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain import storage
from raytrain.data import content_checksum
from raytrain.data.manifest import load_split
from raytrain.data.sample_plan import SamplePlan
from raytrain.data.shards import write_shard
from raytrain.data.reader import PlannedReader, read_rows
from raytrain.errors import UserError

GB = 16  # sequences per global batch


def read_pyarrow(uris: list[str], width: int):
    """The truth, read apart from the reader under test: each Parquet shard whole, in order."""
    for i, uri in enumerate(uris):
        fs, path = storage.resolve(uri)
        col = pq.read_table(path, filesystem=fs, columns=["tokens"])["tokens"].combine_chunks()
        yield i, col.flatten().to_numpy().astype(np.int64).reshape(-1, width)


@pytest.fixture(scope="module")
def many_units(tiny_data, tmp_path_factory):
    """tiny_data's train rows re-sharded into 3-row shards: ~80 units of about 1 KB (Parquet) / 5 KB (tar)."""
    src = load_split(str(tiny_data / "train"))
    out = tmp_path_factory.mktemp("units") / "ds"
    out.mkdir()
    shutil.copy(tiny_data / "tokenizer.json", out / "tokenizer.json")
    rows = np.concatenate([r for _, r in read_pyarrow(list(src.shard_uris), src.seq_len + 1)])
    split_uri, formats = str(out / "train"), ["parquet", "webdataset"]
    shards: dict = {fmt: [] for fmt in formats}
    for i, start in enumerate(range(0, len(rows), 3)):  # prepare's own shard writer, 3 rows a shard
        entries, _ = write_shard(split_uri, i, start, rows[start:start + 3], formats)
        for fmt, entry in entries.items():
            shards[fmt].append(entry)
    manifest = {"format": "parquet", "formats": formats, "seq_len": src.seq_len, "num_samples": int(len(rows)),
                "num_tokens": int(rows.size), "shards": shards, "vocab_size": src.vocab_size, "eot_id": src.eot_id,
                "tokenizer": "../tokenizer.json"}
    storage.write_text(storage.join(split_uri, "manifest.json"), json.dumps(manifest, indent=1))
    return str(out)


@pytest.fixture(scope="module")
def many_units_s3(many_units, s3_server):
    storage.upload_dir(many_units, "s3://raytrain-test/reader/ds")  # the same bytes, uploaded in parallel
    return "s3://raytrain-test/reader/ds"


def _truth(split):
    pq_split = load_split(split.uri, fmt="parquet")
    return np.concatenate([rows for _, rows in read_pyarrow(list(pq_split.shard_uris), split.seq_len + 1)])


def _shard_bytes(split) -> list[int]:
    m = json.loads(storage.read_text(storage.join(split.uri, "manifest.json")))
    return [s["bytes"] for s in m["shards"][split.format]]


def _epoch(split, n, seed=7, steps=None):
    """One epoch read by n ranks: per step the whole global batch (ranks concatenated) and its sample ids."""
    plan = SamplePlan.for_split(split, seed, GB)
    steps = steps or plan.steps_per_epoch
    readers = [PlannedReader(split, plan, plan.lanes_of(r, n), ahead=2, end_step=steps) for r in range(n)]
    batches = []
    try:
        for s in range(steps):
            got = [r.take(s) for r in readers]
            batches.append((np.concatenate([g[0] for g in got]), np.concatenate([g[1].ids for g in got])))
    finally:
        for r in readers:
            r.close()
    return plan, readers, batches


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_each_rank_reads_only_its_units_once_and_batches_do_not_depend_on_n(fmt, where, request):
    split = load_split(request.getfixturevalue("many_units" if where == "local" else "many_units_s3") + "/train",
                       fmt=fmt)
    assert len(split.shard_uris) >= 64
    truth, sizes = _truth(load_split(request.getfixturevalue("many_units") + "/train")), _shard_bytes(split)
    unit_rows = max(split.shard_rows)
    # On S3 (a slow local server) 1 and 2 workers; every N is read locally.
    runs = {n: _epoch(split, n) for n in ((1, 2) if where == "s3" else (1, 2, 4))}
    for n, (plan, readers, batches) in runs.items():
        for (rows, ids), (_, want_ids) in zip(batches, runs[1][2]):
            np.testing.assert_array_equal(rows, truth[ids])  # the rows are the samples the plan names
            assert sorted(ids.tolist()) == sorted(want_ids.tolist())  # the same global batch at any N
        for r, reader in enumerate(readers):
            lanes = plan.lanes_of(r, n)
            mine = {(0, u) for _, _, u in plan.lane_units(0, lanes)}
            opened = reader.units_opened
            assert len(opened) == len(set(opened)), "a unit was read twice"
            assert set(opened) <= mine, "a rank opened a unit that holds none of its samples"
            c = reader.counters()
            assert c["rows_trained"] == plan.steps_per_epoch * (lanes[1] - lanes[0])
            # One epoch: a unit cut by a rank boundary is all that is read beyond what was trained on.
            assert c["rows_read"] <= 1.25 * c["rows_trained"] + unit_rows, (n, r, c)
            read_bytes = sum(sizes[plan.units[u].shard] for _, u in opened)
            # Each unit is its whole shard: one read of exactly its bytes (footer included).
            assert c["bytes_fetched"] == read_bytes, (n, r, c, read_bytes)
        epoch0 = [(u, r) for r, reader in enumerate(readers) for e, u in reader.units_opened if e == 0]
        rows_read = sum(plan.units[u].rows for u, _ in epoch0)
        assert rows_read / plan.trained_per_epoch <= 1.25, (n, rows_read, plan.trained_per_epoch)


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_validation_share_reads_only_the_shards_holding_it(many_units, fmt):
    """Each of N ranks reads its contiguous 1/N of the validation rows: only the shards that hold them."""
    split = load_split(many_units + "/train", fmt=fmt)
    truth, sizes = _truth(split), _shard_bytes(split)
    ends = np.cumsum(split.shard_rows)
    n, share = 4, 40
    for r in range(n):
        counter = storage.ReadCounter()
        lo, hi = r * share, (r + 1) * share
        np.testing.assert_array_equal(read_rows(split, lo, hi, counter=counter), truth[lo:hi])
        first, last = int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(ends, hi - 1, side="right"))
        assert counter.bytes == sum(sizes[first:last + 1]), (r, counter.bytes)


def _damage(src, dst, name):
    shutil.copytree(src, dst)
    p = dst / "train" / name
    p.write_bytes(p.read_bytes()[:300])
    m = json.loads((dst / "train" / "manifest.json").read_text())
    for fmt in m["shards"]:
        for s in m["shards"][fmt]:
            if s["path"] == name:
                s["bytes"] = p.stat().st_size
    (dst / "train" / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("name", ["shard-00005.parquet", "shard-00005.tar"])
def test_bad_shard_is_named_or_skipped_alike_at_any_n(many_units, tmp_path, name):
    from pathlib import Path

    _damage(Path(many_units), tmp_path / "ds", name)
    split = load_split(str(tmp_path / "ds" / "train"), fmt="parquet" if name.endswith("parquet") else "webdataset")
    plan = SamplePlan.for_split(split, 7, GB)
    with pytest.raises(UserError, match=f"shard .*{name} cannot be used.*on_bad_shard=skip"):
        for r in range(4):
            reader = PlannedReader(split, plan, plan.lanes_of(r, 4), end_step=plan.steps_per_epoch)
            try:
                for s in range(plan.steps_per_epoch):
                    reader.take(s)
            finally:
                reader.close()
    filled = {}
    for n in (1, 4):
        readers = [PlannedReader(split, plan, plan.lanes_of(r, n), on_bad_shard="skip", end_step=plan.steps_per_epoch)
                   for r in range(n)]
        filled[n] = np.concatenate([np.concatenate([r.take(s)[0] for r in readers]) for s in range(plan.steps_per_epoch)])
        assert {u for r in readers for u in r.skipped} == {str(tmp_path / "ds" / "train" / name)}
        for r in readers:
            r.close()
    np.testing.assert_array_equal(filled[1], filled[4])  # the gap is filled from the plan alone


@pytest.mark.slow
def test_two_worker_run_trains_the_planned_batches_and_reports_its_reads(many_units, tmp_path, ray_cluster):
    from raytrain.trainer import train
    from tests.helpers import tiny_cfg

    common = ("data.val=null", "run.log_every=5", "checkpoint.every_n_steps=100", "checkpoint.save_final=false",
              "batch.micro_batch_size=8")  # global batch 16: one epoch is 15 steps
    cfg = tiny_cfg(many_units, tmp_path, "planned", *common)
    split = load_split(many_units + "/train")
    plan = SamplePlan.for_split(split, cfg.run.seed, cfg.global_batch)
    steps = plan.steps_per_epoch  # one epoch
    cfg = tiny_cfg(many_units, tmp_path, "planned", *common, f"run.max_steps={steps}")
    summary = train(cfg, log=lambda *_: None)
    recs = [json.loads(x) for x in storage.read_text(storage.join(cfg.run_uri, "metrics.jsonl")).splitlines()]
    logged = [r for r in recs if "loss" in r]
    assert logged and all(r["batch_crc32"] == plan.step(r["step"] - 1).fingerprint() for r in logged)
    # The rows the two ranks trained on, checksummed as read and combined on the step's all-reduce, are the plan's
    # rows of the whole global batch read here by one reader.
    whole = PlannedReader(split, plan, (0, cfg.global_batch), 0, end_step=steps)
    try:
        want = {s + 1: content_checksum.of_batch(whole.take(s)[0]) for s in range(steps)}
    finally:
        whole.close()
    assert all(r["content_checksum"] == want[r["step"]] for r in logged), [r["step"] for r in logged]
    # One epoch, two workers: each unit read once (a unit two ranks share, twice), plus the read-ahead.
    unit_rows, ahead = max(split.shard_rows), 4
    trained = steps * cfg.global_batch
    assert summary["data_rows_trained_per_worker"] == trained / 2
    assert summary["read_amplification"] <= 1.25 + 2 * ahead * unit_rows / trained, summary
    assert summary["data_rows_read_max"] <= 1.25 * trained / 2 + ahead * unit_rows
    shard_bytes = _shard_bytes(split)
    assert summary["data_bytes_fetched_per_worker"] <= 1.25 * sum(shard_bytes) / 2 + ahead * max(shard_bytes)
    assert 0 <= summary["data_wait_frac_max"] < 1
