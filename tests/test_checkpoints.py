"""Checkpoint catalogue: only committed, intact checkpoints count; retention never removes the newest."""

import pytest

from raytrain.ckpt import catalog
from raytrain.ckpt.layout import dir_name, hash_local_files


def _make(run, step: int, commit: bool = True):
    d = run / dir_name(step)
    (d / "engine").mkdir(parents=True)
    (d / "engine" / "weights.pt").write_bytes(b"w" * (100 + step))
    (d / "raytrain_state.json").write_text('{"step": %d}' % step)
    if commit:
        catalog.commit(str(d), step, hash_local_files(str(d)))
    return d


def test_latest_complete_skips_uncommitted_and_corrupt(tmp_path):
    _make(tmp_path, 10)
    _make(tmp_path, 20)
    _make(tmp_path, 30, commit=False)  # crashed before its manifest
    assert catalog.latest_complete(str(tmp_path)).step == 20
    (tmp_path / "checkpoint_00000020" / "engine" / "weights.pt").write_bytes(b"short")  # truncated upload
    warnings = []
    assert catalog.latest_complete(str(tmp_path), log=warnings.append).step == 10
    assert any("checkpoint_00000020" in w and "bytes" in w for w in warnings)
    assert any("checkpoint_00000030" in w and "no manifest" in w for w in warnings)


def test_deleted_manifest_or_file_makes_it_incomplete(tmp_path):
    d = _make(tmp_path, 5)
    assert catalog.verify(str(d)).complete
    (d / "raytrain_state.json").unlink()
    assert "missing raytrain_state.json" in catalog.verify(str(d)).reason
    d2 = _make(tmp_path, 6)
    (d2 / "manifest.json").unlink()
    assert not catalog.verify(str(d2)).complete


def test_deep_verify_catches_same_size_corruption(tmp_path):
    d = _make(tmp_path, 7)
    p = d / "engine" / "weights.pt"
    p.write_bytes(b"x" * p.stat().st_size)
    assert catalog.verify(str(d)).complete
    assert "checksum" in catalog.verify(str(d), deep=True).reason


@pytest.mark.parametrize("keep", [1, 2])
def test_prune_keeps_newest_and_protected(tmp_path, keep):
    for s in (1, 2, 3, 4):
        _make(tmp_path, s)
    protect = (str(tmp_path / "checkpoint_00000001"),)
    deleted = catalog.prune(str(tmp_path), keep, protect=protect)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "checkpoint_00000004" in left and "checkpoint_00000001" in left
    assert len(deleted) == 3 - keep


def test_ckpt_cli_list_and_verify(tmp_path, capsys):
    from raytrain.cli import main

    _make(tmp_path, 1)
    _make(tmp_path, 2)
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert "checkpoint_00000002" in capsys.readouterr().out
    _make(tmp_path, 3, commit=False)
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    assert main(["ckpt", "list", str(tmp_path / "nope")]) == 2


def test_prune_drops_incomplete_older_than_newest_complete(tmp_path):
    _make(tmp_path, 1)
    _make(tmp_path, 2, commit=False)  # a crash left it behind; nothing can resume from it any more
    _make(tmp_path, 3)
    _make(tmp_path, 4, commit=False)  # newer than every complete one: may be in flight, keep
    catalog.prune(str(tmp_path), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_00000001", "checkpoint_00000003",
                                                          "checkpoint_00000004"]


def test_uncommit_makes_it_incomplete(tmp_path):
    d = _make(tmp_path, 9)
    catalog.uncommit(str(d))
    assert not catalog.verify(str(d)).complete
    catalog.uncommit(str(tmp_path / "checkpoint_00000099"))  # missing: no error


def test_prune_keeps_every_mth(tmp_path):
    for s in range(1, 9):
        _make(tmp_path, s * 100)
    catalog.prune(str(tmp_path), keep_last=2, keep_every=300)
    assert sorted(int(p.name.split("_")[1]) for p in tmp_path.iterdir()) == [300, 600, 700, 800]


def test_train_state_keeps_preemptions_and_reads_older_and_newer_files(tmp_path):
    """The counters round-trip through the state file, preemptions included; a file from before that counter
    reads as 0 preemptions, and keys this version does not know are ignored."""
    from raytrain.ckpt.layout import STATE
    from raytrain.ckpt.restore import ResumePoint, peek_state
    from raytrain.ckpt.state import TrainState

    saved = TrainState(step=7, samples_seen=56, tokens_seen=900, world_size=2, restarts=1, global_batch=8,
                       preemptions=3)
    (tmp_path / STATE).write_text(saved.to_json())
    assert peek_state(ResumePoint("run/checkpoint_00000007", str(tmp_path))) == saved
    old = {"step": 4, "samples_seen": 32, "tokens_seen": 10, "world_size": 2, "restarts": 0, "global_batch": 8}
    assert TrainState.from_dict(old).preemptions == 0
    assert TrainState.from_dict({**old, "preemptions": 2, "from_a_newer_version": True}).preemptions == 2
