"""Data mixtures: the plan's shares within the stated bound, independent of N, per-source lanes and epochs;
bad mixtures in one line; the mixed reader on real prepared data (no Ray); the schedule record on resume."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from raytrain.config import load_config
from raytrain.data.manifest import Split, load_split
from raytrain.data.mixed_reader import MixedReader
from raytrain.data.mixture import ID_STRIDE, MixturePlan, bound_slots, compose
from raytrain.data.reader import read_rows
from raytrain.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _split(n: int, rows: int = 40) -> Split:
    k = -(-n // rows)
    return Split(uri=f"mem://{n}", shard_uris=tuple(f"s{i}" for i in range(k)),
                 shard_rows=tuple([rows] * (k - 1) + [n - rows * (k - 1)]), seq_len=8, vocab_size=10, eot_id=0,
                 tokenizer_uri="t")


def _plan(sizes=(4000, 700), stages=((0, (0.8, 0.2)), (50, (0.5, 0.5))), gb=16, seed=1):
    return MixturePlan([_split(n) for n in sizes], [f"s{i}" for i in range(len(sizes))], stages, seed=seed,
                       global_batch=gb, unit_rows=8)


@pytest.mark.parametrize("k,gb", [(2, 16), (3, 512), (8, 4096)])
def test_realised_shares_stay_within_the_stated_bound_over_every_window(k, gb):
    rng = np.random.default_rng(k * gb)
    w = rng.random(k) + 0.02
    p = MixturePlan([_split(10 ** 7, 10 ** 5)] * k, [f"s{i}" for i in range(k)], [(0, tuple(w)), (3000, tuple(w[::-1]))],
                    seed=k, global_batch=gb)
    for stage, (a, b) in enumerate(((0, 3000), (3000, 7000))):
        c = np.diff(p.cuts(stage, np.arange(a, b)), axis=1)  # [step, source] slots
        want = gb * p.stages[stage].weights
        assert ((c == np.floor(want)) | (c == np.ceil(want))).all()  # every batch: floor or ceil of gb * w
        dev = np.concatenate([np.zeros((1, k)), np.cumsum(c - want, axis=0)])
        for T in (1, 2, 7, 64, 500, 2999):
            assert np.abs(dev[T:] - dev[:-T]).max() <= bound_slots(T), T
    np.testing.assert_array_equal(p.counts(100, 3100), np.diff(p.cuts(0, np.arange(100, 3000)), axis=1).sum(0)
                                  + np.diff(p.cuts(1, np.arange(3000, 3100)), axis=1).sum(0))


def test_batches_are_the_same_at_any_worker_count_and_each_source_keeps_its_own_epochs():
    p = _plan()
    L = p.steps_per_epoch(0)
    assert L[1] < L[0]  # the small source's epochs are shorter: it repeats
    for step in (0, 1, 17, int(L[1]), int(L[1]) + 3, 49, 50, 51, 400):
        whole = p.step(step)
        for n in (1, 2, 4, 8):
            parts = [p.step(step, p.lanes_of(r, n)) for r in range(n)]
            np.testing.assert_array_equal(np.concatenate([q.ids for q in parts]), whole.ids)
        assert _plan().step(step).fingerprint() == whole.fingerprint()  # deterministic, computed directly
    assert _plan(seed=2).step(3).fingerprint() != p.step(3).fingerprint()
    # Within one epoch of a source no sample is trained twice; the next epoch is another order.
    for i in (0, 1):
        ids = np.concatenate([(lambda q: q.ids[q.units == i])(p.step(s)) for s in range(min(50, int(L[i])))])
        assert len(ids) == len(set(ids.tolist())) and (ids // ID_STRIDE == i).all()
    e1 = [p.step(s).ids for s in range(int(L[1]), int(L[1]) + 5)]
    assert not np.array_equal(np.concatenate(e1), np.concatenate([p.step(s).ids for s in range(5)]))


def test_each_rank_reads_only_its_units_and_simulated_amplification_stays_near_one():
    from benchkit.dataplane import mixture_figures

    p = _plan(gb=64)
    for n in (2, 4, 8):
        for i in (0, 1):
            spans = [p.source_lanes(i, 0, p.lanes_of(r, n)) for r in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == p.stages[0].lanes[i]
            assert all(b[0] == a[1] for a, b in zip(spans, spans[1:]))  # contiguous, disjoint ranges of lanes
    figs = mixture_figures(log=lambda *_: None, sources=(2, 8), workers=(8, 64, 1024), batches=(1024,),
                           corpus_bytes=10 ** 12)
    assert figs and all(f["met"] and f["value"] <= 1.1 for f in figs)


def test_a_resubmission_with_new_weights_changes_the_plan_only_from_its_step_on():
    old = [{"from_step": 0, "stages": [[0, [0.8, 0.2]], [50, [0.5, 0.5]]]}]
    new = old + [{"from_step": 30, "stages": [[0, [0.2, 0.8]]]}]
    assert compose(old) == [(0, (0.8, 0.2)), (50, (0.5, 0.5))]
    assert compose(new) == [(0, (0.8, 0.2)), (30, (0.2, 0.8))]
    assert compose(old + [{"from_step": 30, "stages": old[0]["stages"]}]) == compose(old)  # unchanged: no stage
    a, b = _plan(stages=compose(old)), _plan(stages=compose(new))
    assert [a.step(s).fingerprint() for s in range(30)] == [b.step(s).fingerprint() for s in range(30)]
    assert (b.step(30).units == 1).sum() in (12, 13) and (a.step(30).units == 1).sum() in (3, 4)


@pytest.mark.parametrize("override,message", [
    ("data.train=[{name: a, path: /x, weight: -0.5}]", "source 'a': weight -0.5 must be >= 0"),
    ("data.train=[{name: a, path: /x, weight: 0}, {name: b, path: /y, weight: 0}]", "every source has weight 0"),
    ("data.mixture_schedule=[{start_step: 5, weights: {books: 1}}]", "names source 'books', which data.train"),
    ("data.mixture_schedule=[{start_step: 9, weights: {a: 1}}, {start_step: 4, weights: {b: 1}}]",
     r"start_step=4 must be greater than the previous stage's \(9\)"),
    ("data.mixture_schedule=[{start_step: 9, weights: {a: 0, b: 0}}]", "every source has weight 0 from step 9"),
])
def test_bad_mixture_configs_are_one_line(override, message):
    base = "data.train=[{name: a, path: /x, weight: 0.8}, {name: b, path: /y, weight: 0.2}]"
    with pytest.raises(UserError, match=message) as e:
        load_config("tiny", [base, override])
    assert "\n" not in str(e.value)


def _sources_cfg(tmp_path, a, b, *more):
    return load_config("tiny", [f"data.train=[{{name: big, path: {a}/train, weight: 0.8}}, "
                                f"{{name: small, path: {b}/train, weight: 0.2}}]", "data.val=null",
                                f"checkpoint.storage={tmp_path}/runs", "model.seq_len=32", *more])


def test_bad_mixture_data_is_one_line_and_exit_2(tmp_path, tiny_data):
    from raytrain.trainer import check_inputs

    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"] = tok.get("added_tokens", []) + [{"id": 9999, "content": "<x>", "single_word": False,
                                                         "lstrip": False, "rstrip": False, "normalized": False,
                                                         "special": True}]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="sources 'big' and 'small' were prepared with different tokenizers"):
        check_inputs(_sources_cfg(tmp_path, tiny_data, other))
    examples = tmp_path / "examples"  # fine-tuning data (token, loss-mask and segment columns): refused, not mixed
    shutil.copytree(tiny_data, examples)
    m = json.loads((examples / "train" / "manifest.json").read_text())
    (examples / "train" / "manifest.json").write_text(json.dumps({**m, "columns": ["tokens", "loss_mask", "segment_ids"]}))
    with pytest.raises(UserError, match="source 'small' holds fine-tuning examples"):
        check_inputs(_sources_cfg(tmp_path, tiny_data, examples))
    (tmp_path / "bare" / "train").mkdir(parents=True)
    with pytest.raises(UserError, match="source 'small'.*has no manifest.json"):
        check_inputs(_sources_cfg(tmp_path, tiny_data, tmp_path / "bare"))
    import subprocess

    r = subprocess.run([sys.executable, "-m", "raytrain", "train", "--config", "tiny",
                        f"data.train=[{{name: a, path: {tiny_data}/train, weight: -1}}]"],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "weight -1.0 must be >= 0" in r.stderr


def test_the_mixed_reader_gives_the_planned_rows_at_1_2_and_4_ranks(tiny_data):
    splits = [load_split(f"{tiny_data}/train"), load_split(f"{tiny_data}/val")]
    plan = MixturePlan(splits, ["train", "val"], [(0, (0.75, 0.25)), (6, (0.5, 0.5))], seed=3, global_batch=8)
    allrows = [read_rows(s, 0, s.num_samples) for s in splits]
    steps = range(2, 14)
    got = {}
    for n in (1, 2, 4):
        readers = [MixedReader(plan, plan.lanes_of(r, n), steps[0], end_step=steps[-1] + 1) for r in range(n)]
        try:
            got[n] = [np.concatenate([rd.take(s)[0] for rd in readers]) for s in steps]
            counters = [rd.counters() for rd in readers]
        finally:
            for rd in readers:
                rd.close()
        assert sum(c["rows_trained"] for c in counters) == 8 * len(steps)
    for k, s in enumerate(steps):
        ids = plan.step(s).ids
        want = np.stack([allrows[i // ID_STRIDE][i % ID_STRIDE] for i in ids.tolist()])
        for n in (1, 2, 4):
            np.testing.assert_array_equal(got[n][k], want)


def test_resubmitting_with_new_weights_is_recorded_and_applies_from_the_resumed_step(tmp_path, tiny_data):
    from raytrain.data.sources import load_sources, plan_mixture
    from raytrain.rundir import MIXTURE, RunDir

    def cfg(*more):
        return _sources_cfg(tmp_path, tiny_data, tiny_data, "run.name=resub", "batch.micro_batch_size=4",
                            "scaling.num_workers=2", *more)

    first = cfg("data.mixture_schedule=[{start_step: 50, weights: {small: 0.5}}]")
    splits, _ = load_sources(first.data)
    a = plan_mixture(first, splits, 0)
    assert plan_mixture(first, splits, 20) == a  # the same mixture resubmitted: nothing new
    two = f"{{name: big, path: {tiny_data}/train, weight: 0.3}}, {{name: small, path: {tiny_data}/train, weight: 0.2}}"
    b = plan_mixture(cfg(f"data.train=[{two}]"), splits, 20)  # new weights from step 20 (its schedule: none)
    assert [[s, [round(x, 6) for x in w]] for s, w in a["stages"]] == [[0, [0.8, 0.2]], [50, [0.615385, 0.384615]]]
    assert [[s, [round(x, 6) for x in w]] for s, w in b["stages"]] == [[0, [0.8, 0.2]], [20, [0.6, 0.4]]]
    rec = RunDir(first.run_uri).read_jsonl(MIXTURE)
    assert [r["from_step"] for r in rec] == [0, 20]
    pa, pb = (MixturePlan.from_dict(m, seed=0, global_batch=8) for m in (a, b))
    assert [pa.step(s).fingerprint() for s in range(20)] == [pb.step(s).fingerprint() for s in range(20)]
    with pytest.raises(UserError, match="may change their weights .* but not the sources"):
        plan_mixture(cfg(f"data.train=[{two.replace('/train, weight: 0.2', '/val, weight: 0.2')}]"), splits, 20)
