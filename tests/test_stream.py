"""The global sample order: deterministic, a permutation per epoch, resumable at any position."""

import numpy as np
import pytest

from raytrain.data.manifest import load_split
from raytrain.data.stream import SampleStream


def _ids(rows: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in rows]


@pytest.fixture(scope="module")
def split(tiny_data):
    return load_split(str(tiny_data / "train"))


def test_each_epoch_is_a_permutation_and_epochs_differ(split):
    n = split.num_samples
    s = SampleStream(split, seed=1, window=50, reader="pyarrow")
    e0, e1 = s.take(n), s.take(n)
    base = SampleStream(split, seed=0, shuffle=False, reader="pyarrow").take(n)
    assert sorted(_ids(e0)) == sorted(_ids(base)) == sorted(_ids(e1))
    assert _ids(e0) != _ids(base) and _ids(e0) != _ids(e1)


@pytest.mark.parametrize("position", [0, 7, 50, 63, 64, 130, 1000])
def test_resume_at_any_position_matches_uninterrupted(split, position):
    full = SampleStream(split, seed=3, window=50, reader="pyarrow").take(position + 40)
    resumed = SampleStream(split, seed=3, window=50, position=position, reader="pyarrow").take(40)
    np.testing.assert_array_equal(resumed, full[position:])


def test_take_sizes_do_not_change_the_order(split):
    a = SampleStream(split, seed=5, window=33, reader="pyarrow")
    b = SampleStream(split, seed=5, window=33, reader="pyarrow", background=True)
    got = np.concatenate([a.take(k) for k in (1, 5, 17, 3, 64, 100)])
    np.testing.assert_array_equal(got, b.take(len(got)))


def test_ray_data_reader_gives_the_same_order(split, ray_cluster):
    want = SampleStream(split, seed=2, window=40, reader="pyarrow").take(2 * split.num_samples + 5)
    got = SampleStream(split, seed=2, window=40, reader="ray", background=True).take(len(want))
    np.testing.assert_array_equal(got, want)
