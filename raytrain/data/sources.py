"""Driver side of a data mixture: load and check its sources, and keep the run's schedule in mixture.jsonl.

Every source must be a prepared split with the same tokenizer and packing length; the checks run before any
worker starts. A run's mixture is recorded at its first submission; a resubmission with other weights (or
another schedule) appends a record that applies from the step it resumes at, so earlier steps keep the
batches they were trained on and the plan from that step on follows the new weights.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from raytrain import storage
from raytrain.data.manifest import Split, load_split
from raytrain.data.mixture import MixturePlan, compose, stages_of
from raytrain.errors import UserError
from raytrain.rundir import MIXTURE, RunDir


def is_mixture(data_cfg) -> bool:
    return isinstance(data_cfg.train, list)


def train_uri(data_cfg) -> Optional[str]:
    """The (first) train split's URI: where a single-split tool looks for the run's tokenizer."""
    return data_cfg.train[0].path if is_mixture(data_cfg) else data_cfg.train


def _tokenizer_digest(split: Split, what: str) -> str:
    try:
        return hashlib.sha256(storage.read_bytes(split.tokenizer_uri)).hexdigest()
    except UserError as e:
        raise UserError(f"{what}: its tokenizer cannot be read ({e}); prepare the source again") from None


def load_sources(data_cfg, *, checksums: bool = False) -> tuple[list[Split], dict[str, Split]]:
    """(train split per source, in data.train's order; {name: val split} for the sources that have one).
    One line each: a source with no manifest, sources with different tokenizers or packing lengths."""
    splits, vals, digests = [], {}, []
    for s in data_cfg.train:
        what = f"data.train source {s.name!r}"
        split = load_split(s.path, what, checksums=checksums, fmt=data_cfg.format)
        digests.append(_tokenizer_digest(split, what))
        if digests[-1] != digests[0]:
            first = data_cfg.train[0]
            raise UserError(f"data.train sources {first.name!r} and {s.name!r} were prepared with different "
                            f"tokenizers ({splits[0].tokenizer_uri} vs {split.tokenizer_uri}); prepare every source "
                            f"with one tokenizer (`raytrain prepare tokenizer={splits[0].tokenizer_uri}`)")
        if splits and split.seq_len != splits[0].seq_len:
            raise UserError(f"data.train source {s.name!r} was packed for seq_len={split.seq_len}, source "
                            f"{data_cfg.train[0].name!r} for {splits[0].seq_len}; prepare them with one seq_len")
        if len(split.columns) > 1:  # the mixture reader moves token rows only; masks would be dropped silently
            raise UserError(f"{what} holds fine-tuning examples (columns {', '.join(split.columns)}); a mixture of "
                            "example data is not supported yet: prepare the sources together into one split "
                            "(`raytrain prepare inputs=[a.jsonl,b.jsonl] format=...`) and train on it")
        splits.append(split)
        if s.val:
            vals[s.name] = load_split(s.val, f"data.train source {s.name!r} val", checksums=checksums,
                                      fmt=data_cfg.format)
            if _tokenizer_digest(vals[s.name], what) != digests[0]:
                raise UserError(f"{what}: its val split {s.val} was prepared with another tokenizer than its "
                                "train split; prepare both with one tokenizer")
    return splits, vals


def record(cfg, resume_step: int) -> list[dict]:
    """The run's recorded mixtures, with this submission's appended when its sources' weights or schedule
    differ from what the run trains by (from `resume_step` on). A change of the sources themselves is refused."""
    rd = RunDir(cfg.run_uri)
    records = rd.read_jsonl(MIXTURE)
    sources = [{"name": s.name, "path": storage.absolute(s.path)} for s in cfg.data.train]
    stages = [[s, list(w)] for s, w in stages_of(cfg.data)]
    if records and [{"name": s["name"], "path": s["path"]} for s in records[-1]["sources"]] != sources:
        was = ", ".join(f"{s['name']}={s['path']}" for s in records[-1]["sources"])
        raise UserError(f"run {cfg.run.name} trains on the sources {was}; a resumed run may change their weights "
                        "(data.train[*].weight, data.mixture_schedule) but not the sources: start a new run.name")
    new = {"from_step": resume_step if records else 0, "sources": sources, "stages": stages}
    if not records or compose(records + [new]) != compose(records):
        rd.append_jsonl(MIXTURE, new)
        records.append(new)
    return records


def plan_mixture(cfg, splits: list[Split], resume_step: int) -> dict:
    """The mixture the workers train by (MixturePlan.to_dict), checked on the driver."""
    stages = compose(record(cfg, resume_step))
    plan = MixturePlan(splits, [s.name for s in cfg.data.train], stages, seed=cfg.run.seed,
                       global_batch=cfg.global_batch, shuffle=cfg.data.shuffle)
    return plan.to_dict()
