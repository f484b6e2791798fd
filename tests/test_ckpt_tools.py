"""Versions and retention on synthetic checkpoints: tags, rollback markers, age-based prune, the ckpt CLI."""

import json
import time

import pytest

from raytrain.ckpt import catalog
from raytrain.ckpt.layout import dir_name, hash_local_files, timestamp
from raytrain.cli import main
from raytrain.errors import UserError

DAY = 86400


def _make(run, step: int, age_days: float = 0.0, commit: bool = True):
    d = run / dir_name(step)
    (d / "engine").mkdir(parents=True)
    (d / "engine" / "weights.pt").write_bytes(b"w" * (100 + step))
    (d / "config.yaml").write_text(f"run:\n  name: r\n  max_steps: {step}\n")
    if commit:
        when = timestamp(time.time() - age_days * DAY)
        catalog.commit(str(d), step, hash_local_files(str(d)), {"committed": when})
    return d


def _recommit(run, step: int) -> None:
    """What a save at an existing step does: uncommit, rewrite, commit."""
    d = str(run / dir_name(step))
    catalog.uncommit(d)
    catalog.commit(d, step, hash_local_files(d))


def _steps(run) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in run.glob("checkpoint_*"))


def test_tag_records_step_and_config_and_refuses_incomplete(tmp_path):
    _make(tmp_path, 10)
    _make(tmp_path, 20)
    _make(tmp_path, 30, commit=False)
    rec = catalog.tag(str(tmp_path), "v1.0", step=10)
    saved = json.loads((tmp_path / "tags" / "v1.0.json").read_text())
    assert saved["step"] == 10 and saved["checkpoint"] == "checkpoint_00000010" == rec["checkpoint"]
    assert saved["config"] == {"run": {"name": "r", "max_steps": 10}}
    assert catalog.tag(str(tmp_path), "latest")["step"] == 20  # default: newest complete
    with pytest.raises(UserError, match="already names checkpoint_00000010"):
        catalog.tag(str(tmp_path), "v1.0", step=20)
    assert catalog.tag(str(tmp_path), "v1.0", step=20, force=True)["step"] == 20
    with pytest.raises(UserError, match=r"no complete checkpoint at step 30 .*complete steps: \[10, 20\]"):
        catalog.tag(str(tmp_path), "v2", step=30)
    with pytest.raises(UserError, match="use letters"):
        catalog.tag(str(tmp_path), "../evil", step=10)


def test_rollback_caps_latest_complete_and_follows_the_new_timeline(tmp_path):
    run = str(tmp_path)
    for s in (5, 10, 15, 20):
        _make(tmp_path, s)
    catalog.tag(run, "good", step=10)
    catalog.set_resume_marker(run, "good")
    assert catalog.latest_complete(run).step == 10
    # The resumed run commits step 15 again: older-timeline step 20 still lies ahead, so the marker
    # follows the new timeline (a crash now resumes from the new 15, never the old 20).
    _recommit(tmp_path, 15)
    assert catalog.read_resume_marker(run)["step"] == 15 and catalog.latest_complete(run).step == 15
    # Past every old checkpoint: the marker is consumed, later resumes use the newest checkpoint.
    _recommit(tmp_path, 20)
    assert catalog.read_resume_marker(run) is None and catalog.latest_complete(run).step == 20
    with pytest.raises(UserError, match="no tag 'nope'.*tags: good"):
        catalog.set_resume_marker(run, "nope")


def test_prune_never_deletes_tagged_final_latest_or_rollback_target(tmp_path):
    run = str(tmp_path)
    for s in range(1, 9):
        _make(tmp_path, s, age_days=30 - s)  # all older than a week
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint": f"{run}/checkpoint_00000008"}))
    catalog.tag(run, "v1.0", step=2)
    catalog.set_resume_marker(run, step=6)
    deleted = catalog.prune(run, keep_last=None, older_than_s=7 * DAY)
    # 2 tagged, 6 rollback target and latest usable, 7 after the target (kept, unused), 8 final.
    assert _steps(tmp_path) == [2, 6, 7, 8]
    assert sorted(int(u.rsplit("_", 1)[1]) for u in deleted) == [1, 3, 4, 5]


def test_worker_prune_keeps_tags_and_checkpoints_after_a_rollback_target(tmp_path):
    """The training loop prunes with keep_last after each save; tags and the old timeline survive it."""
    run = str(tmp_path)
    for s in (1, 2, 3, 4, 5):
        _make(tmp_path, s)
    catalog.tag(run, "v1", step=1)
    catalog.set_resume_marker(run, step=3)
    catalog.prune(run, keep_last=1, protect=(str(tmp_path / "checkpoint_00000003"),))
    assert _steps(tmp_path) == [1, 3, 4, 5]


def test_age_policy_keeps_young_ones(tmp_path):
    for s, age in ((1, 10), (2, 9), (3, 1), (4, 0)):
        _make(tmp_path, s, age_days=age)
    doomed, kept = catalog.retention_plan(str(tmp_path), older_than_s=7 * DAY)
    assert [int(u.rsplit("_", 1)[1]) for u in doomed] == [1, 2]
    assert kept[str(tmp_path / "checkpoint_00000003")] == "younger than the age limit"
    doomed, _ = catalog.retention_plan(str(tmp_path), older_than_s=7 * DAY, keep_last=3)
    assert [int(u.rsplit("_", 1)[1]) for u in doomed] == [1]


def test_ckpt_cli_tag_rollback_prune(tmp_path, capsys):
    run = str(tmp_path)
    for s in (1, 2, 3, 4):
        _make(tmp_path, s, age_days=10)
    assert main(["ckpt", "tag", run, "v1.0", "--step", "2"]) == 0
    assert main(["ckpt", "list", run]) == 0
    assert "[tag v1.0]" in capsys.readouterr().out
    assert main(["ckpt", "prune", run, "--older-than", "7d"]) == 0  # dry run
    out = capsys.readouterr().out
    assert "would delete  checkpoint_00000001" in out and "would delete  checkpoint_00000003" in out
    assert "keep    checkpoint_00000002  (tagged v1.0)" in out and _steps(tmp_path) == [1, 2, 3, 4]
    assert main(["ckpt", "prune", run, "--older-than", "7d", "--yes"]) == 0
    assert _steps(tmp_path) == [2, 4]
    assert main(["ckpt", "rollback", run, "v1.0"]) == 0
    assert catalog.latest_complete(run).step == 2
    assert main(["ckpt", "rollback", run, "--clear"]) == 0
    assert catalog.latest_complete(run).step == 4
    assert main(["ckpt", "prune", run]) == 2  # no policy given
    assert main(["ckpt", "prune", run, "--older-than", "7 days"]) == 2
    assert "use a number and a unit" in capsys.readouterr().err
