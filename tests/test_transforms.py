"""data.transform (raytrain/data/transforms.py): seeded by (run seed, epoch, unit); fill-in-the-middle follows the
recipe; a transform that cannot be imported, raises or changes the shape is one line before training starts."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from raytrain.data.prepare import EOT, train_tokenizer
from raytrain.data.transforms import FIM_SENTINELS, Transform, check
from raytrain.errors import UserError

W = 33  # seq_len 32


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300, [EOT, *FIM_SENTINELS])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.to_str())
    return SimpleNamespace(seq_len=W - 1, tokenizer_uri=str(path), ids=[tok.token_to_id(s) for s in FIM_SENTINELS])


def _rows(n: int) -> np.ndarray:
    return (np.arange(n * W).reshape(n, W) % 200 + 50).astype(np.int32)  # ids 50..249: never a sentinel (1..3)


def test_fim_rows_follow_the_recipe_at_the_rate(split):
    pre, mid, suf = split.ids
    rows = _rows(4000)
    out = Transform("fim", {"rate": 0.5, "spm_rate": 0.5}, seed=0)(rows, epoch=0, unit=3, split=split)
    n = W - 3
    psm = spm = 0
    for orig, got in zip(rows, out):
        if not (got == pre).any():
            assert np.array_equal(got, orig)  # untouched
            continue
        assert got[0] == pre and (got == suf).sum() == 1 and (got == mid).sum() == 1
        if got[1] == suf:  # SPM: <pre> <suf> suffix <mid> prefix middle
            spm += 1
            k = int(np.flatnonzero(got == mid)[0])
            suffix, pm = got[2:k], got[k + 1:]
            assert np.array_equal(np.concatenate([pm, suffix]), orig[:n])
        else:  # PSM: <pre> prefix <suf> suffix <mid> middle
            psm += 1
            s, m = int(np.flatnonzero(got == suf)[0]), int(np.flatnonzero(got == mid)[0])
            assert s < m
            prefix, suffix, middle = got[1:s], got[s + 1:m], got[m + 1:]
            assert np.array_equal(np.concatenate([prefix, middle, suffix]), orig[:n])
    chosen = psm + spm
    bound = 4 * math.sqrt(len(rows) * 0.25)  # 4 standard deviations of Binomial(4000, 0.5)
    assert abs(chosen - 2000) < bound and abs(spm - chosen / 2) < 4 * math.sqrt(chosen * 0.25)


def test_the_same_unit_gets_the_same_rows_and_another_unit_others(split):
    rows = _rows(64)
    t = Transform("fim", {"rate": 0.5}, seed=7)
    a = t(rows, epoch=1, unit=5, split=split)
    assert np.array_equal(a, Transform("fim", {"rate": 0.5}, seed=7)(rows, epoch=1, unit=5, split=split))
    assert not np.array_equal(a, t(rows, epoch=1, unit=6, split=split))
    assert not np.array_equal(a, t(rows, epoch=2, unit=5, split=split))


def _bad_shape(rows, **_):
    return rows[:, :-1]


def _raises(rows, **_):
    raise ValueError("no such token")


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_x:f", r"^data.transform no_such_module_x:f: cannot import it \(No module named"),
    ("tests.test_transforms:_raises", r"^data.transform tests.test_transforms:_raises raised ValueError on unit 0 "
                                      r"\(epoch 0\): no such token$"),
    ("tests.test_transforms:_bad_shape", r"^data.transform tests.test_transforms:_bad_shape returned int32 rows of "
                                         r"shape \(4, 32\) for a unit of \(4, 33\)"),
])
def test_a_bad_transform_is_one_line_before_training(split, spec, message):
    cfg = SimpleNamespace(transform=spec, transform_args={})
    with pytest.raises(UserError, match=message):
        check(cfg, split, 0, lambda: _rows(4))


def test_a_bad_transform_stops_train_with_exit_2_before_ray(tiny_data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raytrain", "train", "-c", "tiny", f"data.train={tiny_data}/train",
                           f"checkpoint.storage={tmp_path}", "data.transform=tests.test_transforms:_raises"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("raytrain: error: data.transform tests.test_transforms:_raises raised ValueError"), \
        lines[-3:]
