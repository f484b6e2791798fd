"""WebDataset shards: written beside Parquet, read by stock libraries, same sample order in training (local and S3),
restartable writing, and bad shards met during training named or skipped and counted."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain import storage
from raytrain.data import prepare as prep
from raytrain.data.manifest import load_split
from raytrain.data.prepare import PrepareConfig, prepare
from raytrain.data.sample_plan import SamplePlan
from raytrain.data.reader import PlannedReader, read_rows
from raytrain.errors import UserError

QUIET = {"log": lambda *_: None}


def _cfg(corpus_dir, out, **kw):
    return PrepareConfig(inputs=[str(corpus_dir)], out=str(out), vocab_size=300, seq_len=32, shard_rows=64,
                         near_dup_threshold=1.0, val_fraction=0.1, formats=["parquet", "webdataset"], **kw)


@pytest.fixture(scope="module")
def both(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("both") / "ds"
    prepare(_cfg(corpus_dir, out), **QUIET)
    return out


def _tar_rows(paths):
    import webdataset as wds

    return np.stack([s["tokens.npy"] for s in wds.WebDataset([str(p) for p in paths], shardshuffle=False).decode()])


def test_manifest_lists_every_shard_per_format_and_stock_readers_agree(both):
    m = json.loads((both / "train" / "manifest.json").read_text())
    assert m["formats"] == ["parquet", "webdataset"]
    pq_shards, tar_shards = m["shards"]["parquet"], m["shards"]["webdataset"]
    assert len(pq_shards) == len(tar_shards) >= 2
    for s in pq_shards + tar_shards:
        assert set(s) >= {"uri", "rows", "tokens", "bytes", "sha256"}
        assert s["tokens"] == s["rows"] * 33 and (both / "train" / s["path"]).stat().st_size == s["bytes"]
    # pyarrow reads the Parquet shards, the stock webdataset library reads the tars: same rows, same order.
    from_parquet = np.concatenate([np.stack(pq.read_table(both / "train" / s["path"])["tokens"].to_numpy(
        zero_copy_only=False)) for s in pq_shards])
    from_tar = _tar_rows(both / "train" / s["path"] for s in tar_shards)
    assert from_tar.dtype == np.int32 and from_tar.shape == (m["num_samples"], 33)
    np.testing.assert_array_equal(from_tar, from_parquet)
    assert sum(s["rows"] for s in tar_shards) == m["num_samples"]


def _planned(split, gb: int, start: int, end: int, **kw) -> tuple[np.ndarray, PlannedReader]:
    plan = SamplePlan.for_split(split, seed=4, global_batch=gb)
    reader = PlannedReader(split, plan, (0, gb), start, end_step=end, **kw)
    try:
        return np.concatenate([reader.take(t)[0] for t in range(start, end)]), reader
    finally:
        reader.close()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_both_formats_stream_identical_token_sequences(both, where, s3_server):
    base = str(both)
    if where == "s3":
        base = "s3://raytrain-test/wds-roundtrip"
        for p in both.rglob("*"):
            if p.is_file():
                storage.upload_file(str(p), storage.join(base, str(p.relative_to(both))))
    parquet = load_split(f"{base}/train", checksums=True)
    tar = load_split(f"{base}/train", checksums=True, fmt="webdataset")
    np.testing.assert_array_equal(read_rows(tar, 0, tar.num_samples), read_rows(parquet, 0, parquet.num_samples))
    gb = 16
    steps = 2 * (parquet.num_samples // gb) + 1  # across an epoch boundary
    want, _ = _planned(parquet, gb, 0, steps)
    got, _ = _planned(tar, gb, 0, steps)
    np.testing.assert_array_equal(got, want)
    resumed, _ = _planned(tar, gb, 5, steps)  # resuming mid-epoch reads the same rows from there
    np.testing.assert_array_equal(resumed, want[5 * gb:])


def test_format_not_prepared_is_named(tiny_data):
    with pytest.raises(UserError, match="not prepared as webdataset.*formats=\\[webdataset\\]"):
        load_split(str(tiny_data / "train"), "data.train", fmt="webdataset")


def test_default_format_is_the_first_prepared(both, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(both, d)
    m = json.loads((d / "train" / "manifest.json").read_text())
    m["format"], m["formats"], m["shards"] = "webdataset", ["webdataset"], {"webdataset": m["shards"]["webdataset"]}
    (d / "train" / "manifest.json").write_text(json.dumps(m))
    assert load_split(str(d / "train")).format == "webdataset"  # tools that do not ask for a format
    assert load_split(str(both / "train")).format == "parquet"


def test_corrupt_tar_caught_by_manifest_check(both, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(both, d)
    tar = d / "train" / "shard-00001.tar"
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF  # same size: only the checksum can tell
    tar.write_bytes(bytes(data))
    load_split(str(d / "train"), fmt="webdataset")  # sizes still match
    with pytest.raises(UserError, match="shard-00001.tar is corrupt"):
        load_split(str(d / "train"), "data.train", checksums=True, fmt="webdataset")
    tar.write_bytes(bytes(data[:-1024]))
    with pytest.raises(UserError, match="shard-00001.tar has .* bytes, manifest says"):
        load_split(str(d / "train"), "data.train", fmt="webdataset")


def _damage_after_check(d, name, cut):
    """A shard that goes bad after the manifest check (the manifest's size is made to match)."""
    p = d / "train" / name
    p.write_bytes(p.read_bytes()[:cut])
    m = json.loads((d / "train" / "manifest.json").read_text())
    fmt = "webdataset" if name.endswith(".tar") else "parquet"
    for s in m["shards"][fmt]:
        if s["path"] == name:
            s["bytes"] = p.stat().st_size
    (d / "train" / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("name, cut", [
    ("shard-00001.tar", 20_000),       # truncated mid-member
    ("shard-00001.tar", 1024 * 10),    # truncated on a member boundary: too few rows
    ("shard-00001.parquet", 300),      # corrupt Parquet
])
def test_bad_shard_is_named_or_skipped_and_counted(both, tmp_path, name, cut):
    d = tmp_path / "ds"
    shutil.copytree(both, d)
    fmt = "webdataset" if name.endswith(".tar") else "parquet"
    good = load_split(str(both / "train"), fmt=fmt)
    _damage_after_check(d, name, cut)
    split = load_split(str(d / "train"), fmt=fmt)
    uri = str(d / "train" / name)
    # Split order (validation, eval): named, or left out.
    with pytest.raises(UserError, match=f"shard .*{name} cannot be used.*on_bad_shard=skip"):
        read_rows(split, 0, split.num_samples)
    skipped = []
    got = read_rows(split, 0, split.num_samples, "skip", skipped=skipped)
    want = read_rows(good, 0, good.num_samples)
    np.testing.assert_array_equal(got, np.concatenate([want[:64], want[128:]]))  # exactly its 64 rows fewer
    assert skipped == [uri]
    # Plan order (training): named, or its places filled from the next readable unit, and counted once.
    steps = 2 * (split.num_samples // 16)
    with pytest.raises(UserError, match=f"shard .*{name} cannot be used.*on_bad_shard=skip"):
        _planned(split, 16, 0, steps)
    rows, reader = _planned(split, 16, 0, steps, on_bad_shard="skip")  # two epochs
    assert len(rows) == steps * 16 and reader.skipped == [uri]


def test_killed_prepare_resumes_and_skips_verified_shards(corpus_dir, tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    prepare(_cfg(corpus_dir, clean), **QUIET)
    out = tmp_path / "resumed"
    real_write, writes = storage.write_bytes, []

    def dying_write(uri, data):
        if uri.endswith((".parquet", ".tar")) and "/provenance/" not in uri:  # shard files (not their provenance)
            if len(writes) == 3:
                raise KeyboardInterrupt("killed")  # the process dies mid-way through the shards
            writes.append(uri)
        real_write(uri, data)

    monkeypatch.setattr(storage, "write_bytes", dying_write)
    with pytest.raises(KeyboardInterrupt):
        prepare(_cfg(corpus_dir, out), **QUIET)
    monkeypatch.setattr(storage, "write_bytes", real_write)
    assert not (out / "train" / "manifest.json").exists()
    first = {u: os.stat(u).st_mtime_ns for u in writes}
    # One finished shard went bad meanwhile: it must be rewritten, not trusted.
    (out / "train" / "shard-00001.parquet").write_bytes(b"garbage")

    lines = []
    prepare(_cfg(corpus_dir, out), log=lines.append)
    assert any("2 shard file(s) already written and verified" in x for x in lines), lines
    for u in writes:
        if not u.endswith("shard-00001.parquet"):
            assert os.stat(u).st_mtime_ns == first[u]  # verified and left alone
    for split in ("train", "val"):
        a = json.loads((clean / split / "manifest.json").read_text())["shards"]
        b = json.loads((out / split / "manifest.json").read_text())["shards"]
        for fmt in a:
            assert [(s["path"], s["sha256"]) for s in a[fmt]] == [(s["path"], s["sha256"]) for s in b[fmt]]
    load_split(str(out / "train"), checksums=True, fmt="webdataset")
    load_split(str(out / "train"), checksums=True)
    assert prep.WRITTEN in os.listdir(out / "train")


@pytest.mark.slow
def test_training_from_webdataset_skips_a_truncated_tar_and_counts_it(both, tmp_path, ray_cluster):
    from tests.helpers import tiny_cfg

    from raytrain.trainer import train

    d = tmp_path / "ds"
    shutil.copytree(both, d)
    _damage_after_check(d, "shard-00000.tar", 20_000)
    # One worker (the rank that meets the damage is the point, not how many share the shards: test_data_reader).
    summary = train(tiny_cfg(d, tmp_path / "runs", "wds", "data.format=webdataset", "data.on_bad_shard=skip",
                             "scaling.num_workers=1", "run.max_steps=6", "checkpoint.every_n_steps=100",
                             "checkpoint.save_final=false"),
                    log=lambda *_: None)
    assert summary["steps"] == 6
    rows = [json.loads(x) for x in (tmp_path / "runs" / "wds" / "metrics.jsonl").read_text().splitlines()]
    assert [r["data_skipped_shards"] for r in rows if "loss" in r][-1] == 1
    with pytest.raises(UserError, match="shard .*shard-00000.tar cannot be used"):
        train(tiny_cfg(d, tmp_path / "runs", "wds2", "data.format=webdataset",
                       "scaling.num_workers=1", "run.max_steps=3",
                       "checkpoint.save_final=false"), log=lambda *_: None)


def test_prepare_straight_to_s3_and_rerun_skips_written_shards(corpus_dir, s3_server):
    out = "s3://raytrain-test/prepared-wds"
    prepare(_cfg(corpus_dir, out, engine="local"), **QUIET)
    fs, path = storage.resolve(f"{out}/train/shard-00000.tar")
    before = fs.get_file_info(path).mtime
    lines = []
    prepare(_cfg(corpus_dir, out, engine="local"), log=lines.append)
    train = load_split(f"{out}/train", checksums=True, fmt="webdataset")
    assert any(f"{2 * len(train.shard_uris)} shard file(s) already written and verified, 0 written" in x for x in lines)
    assert fs.get_file_info(path).mtime == before
    rows = read_rows(train, 0, train.num_samples)
    parquet = read_rows(load_split(f"{out}/train"), 0, train.num_samples)
    np.testing.assert_array_equal(rows, parquet)
