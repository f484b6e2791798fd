"""Config tree: recipes by name and path, dotted overrides, and every validation error names its key."""

import subprocess
import sys

import pytest

from raytrain.config import load_config
from raytrain.errors import UserError


def test_recipe_by_name_and_overrides():
    cfg = load_config("tiny", ["model.n_layer=4", "optim.lr=3e-4", "deepspeed.extra.zero_optimization.x=1"])
    assert cfg.model.n_layer == 4 and cfg.optim.lr == 3e-4
    assert cfg.deepspeed.extra == {"zero_optimization": {"x": 1}}
    assert cfg.global_batch == cfg.batch.micro_batch_size * cfg.accumulation * cfg.scaling.num_workers


def test_recipe_by_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("model:\n  n_layer: 3\nrun:\n  name: mine\n")
    cfg = load_config(str(p))
    assert cfg.model.n_layer == 3 and cfg.run.name == "mine"


@pytest.mark.parametrize("overrides, needle", [
    (["no.such.key=1"], "no.such.key"),
    (["model.nlayer=2"], "model.nlayer"),
    (["model.n_layer=two"], "model.n_layer"),
    (["model.n_layer=2.5"], "model.n_layer"),
    (["optim.lr=fast"], "optim.lr"),
    (["precision.dtype=fp8"], "precision.dtype"),
    (["model.n_layer.x=1"], "model.n_layer"),
    (["model.hidden_size=100", "model.n_head=3"], "model.hidden_size"),
    (["batch.global_batch_size=17"], "batch.global_batch_size"),
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    (["deepspeed.offload_param=cpu"], "zero_stage=3"),
    (["scaling.use_gpu=true", "scaling.gpus_per_worker=2"], "scaling.gpus_per_worker=2"),
])
def test_bad_config_names_the_key(overrides, needle):
    with pytest.raises(UserError) as e:
        load_config("tiny", overrides)
    assert needle in str(e.value)


def test_unknown_recipe_lists_known():
    with pytest.raises(UserError, match="known recipes: .*tiny"):
        load_config("nope")


def test_yaml_unknown_key_and_wrong_type(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  n_layer: '4'\n  colour: red\n")
    with pytest.raises(UserError) as e:
        load_config(str(p))
    assert "model.colour" in str(e.value) and "model.n_layer" in str(e.value)


def test_accumulation_derived_from_global_batch():
    cfg = load_config("tiny", ["batch.gradient_accumulation_steps=null", "batch.global_batch_size=64"])
    assert cfg.accumulation == 64 // (8 * 2)


def test_cli_unknown_key_exits_nonzero_naming_it():
    r = subprocess.run([sys.executable, "-m", "raytrain", "train", "--config", "tiny", "no.such.key=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no.such.key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # one clear line, no traceback


def test_yaml_scientific_notation_is_a_number(tmp_path):
    p = tmp_path / "sci.yaml"
    p.write_text("optim:\n  lr: 3e-4\n")
    assert load_config(str(p)).optim.lr == 3e-4


def test_config_reference_doc_is_current():
    from pathlib import Path

    from raytrain.config import reference_markdown
    from raytrain.data.prepare import reference_markdown as prepare_keys

    doc = Path(__file__).parent.parent / "docs" / "CONFIG.md"
    assert doc.read_text() == reference_markdown() + "\n" + prepare_keys() + "\n", \
        "regenerate: raytrain config --reference > docs/CONFIG.md"


def test_prepare_help_lists_every_prepare_key_and_the_version_and_recipe_are_said(capsys):
    """`raytrain prepare --help` names every key of the prepare schema (nested ones dotted) with its default;
    `raytrain --version` prints the installed version; `raytrain config` without --config says which recipe it took."""
    from importlib.metadata import version

    from raytrain.cli import main
    from raytrain.config import key_rows
    from raytrain.data.prepare import PrepareConfig

    with pytest.raises(SystemExit) as e:
        main(["prepare", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    keys = [k for k, *_ in key_rows(PrepareConfig)]
    assert "decontaminate.ngram" in keys and len(keys) == len(set(keys)) > 30
    for key, _, default, _ in key_rows(PrepareConfig):
        assert f"  {key}: " in out and f"default {default}" in out, key
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"raytrain {version('raytrain')}"
    assert main(["config"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("# no --config given: the laptop recipe `tiny`"), first


def test_retired_key_in_a_file_loads_with_a_warning_but_not_as_an_override(tmp_path, capsys):
    recipe = tmp_path / "old.yaml"
    recipe.write_text("data:\n  shuffle_window: 4096\ncheckpoint:\n  preemption_check_s: 2.0\n")
    cfg = load_config(str(recipe))
    assert "shuffle_window" not in cfg.to_dict()["data"]
    err = capsys.readouterr().err
    assert "'data.shuffle_window' is no longer used" in err and "'checkpoint.preemption_check_s'" in err
    with pytest.raises(UserError, match="'data.prefetch_batches' is no longer used: .*leave it out"):
        load_config("tiny", ["data.prefetch_batches=4"])


@pytest.mark.parametrize("old, new", [("metrics.cpu_peak_tflops=0.5", "metrics.peak_tflops"),
                                      ("checkpoint.staging_dir=/tmp/x", "checkpoint.local_dir")])
def test_a_merged_key_names_the_one_that_replaced_it(old, new):
    with pytest.raises(UserError) as e:
        load_config("tiny", [old])
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"'{old.split('=')[0]}' is no longer used: set {new} instead" in msg, msg


def test_allocator_settings_of_the_driver_reach_the_training_workers(monkeypatch):
    """MALLOC_MMAP_THRESHOLD_ (ZeRO-3 peak host memory per worker falls as 1/N with it) set where the run is
    submitted goes into the workers' runtime env; nothing is set when the user set nothing."""
    from raytrain.trainer import PROPAGATED_ENV, worker_env

    for k in PROPAGATED_ENV:
        monkeypatch.delenv(k, raising=False)
    assert worker_env() == {}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert worker_env() == {"MALLOC_MMAP_THRESHOLD_": "65536"}


def test_the_readmes_error_example_is_what_raytrain_prints(capsys):
    from pathlib import Path

    from raytrain.cli import main

    assert main(["config", "--config", "tiny", "no.such.key=1"]) == 2
    line = capsys.readouterr().err.strip()
    assert line in (Path(__file__).parent.parent / "README.md").read_text(), line


def test_a_command_whose_reader_goes_away_ends_without_a_traceback():
    """`raytrain config --reference | head -1`: the pipe's reader has gone when the command writes (here: its read
    end closed before the start); no BrokenPipeError traceback, exit 141 (128 + SIGPIPE)."""
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from raytrain.cli import main\n"
            "sys.exit(main(['config', '--reference']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 141, (proc.returncode, proc.stderr[-500:])
