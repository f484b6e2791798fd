"""`raytrain data trace RUN --step N`: the documents a step's global batch trained on, reconstructed from the run
directory's records and the data's provenance, without replaying training.

Which batch a step trained on: the data position (samples before it) is anchored by the run's own records in
metrics.jsonl, in the order of its surviving timeline (a rollback rewinds the file and appends its record): every
log record carries its batch's `data_position`; a rollback record says where the step after it starts
(`skipped[1]`); between anchors each step moves one global batch. The batch is then the sample plan's (the
mixture's, with its recorded schedule) at global batch index position // global_batch, read as the workers read
it (the same reader, its transform included), so its content checksum must equal the one logged at that step.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from raytrain import storage
from raytrain.errors import UserError
from raytrain.rundir import ATTEMPTS, CONFIG, METRICS, MIXTURE, PROGRESS, RunDir


class RunData:
    """A run's data as its workers read it: its config, its (mixture) plan and readers of whole global batches."""

    def __init__(self, run_uri: str):
        from raytrain.config import Config, load_yaml

        self.run_uri = storage.absolute(run_uri)
        self.rd = RunDir(self.run_uri)
        if not self.rd.exists(CONFIG):
            raise UserError(f"{self.run_uri} has no {CONFIG}: not a run directory (<checkpoint.storage>/<run.name>)")
        self.cfg = Config.model_validate(load_yaml(storage.read_text(self.rd.uri(CONFIG))))
        self.records = self.rd.read_jsonl(METRICS)
        self.gb = self.cfg.global_batch
        self._plan = None
        from raytrain.data import sources

        self.mixture = sources.is_mixture(self.cfg.data)

    @property
    def plan(self):
        """(plan, {source index: split}, names): a SamplePlan of the one split, or the recorded mixture's plan."""
        if self._plan is None:
            from raytrain.data import sources
            from raytrain.data.manifest import load_split
            from raytrain.data.mixture import MixturePlan, compose
            from raytrain.data.sample_plan import SamplePlan

            data = self.cfg.data
            if sources.is_mixture(data):
                recs = self.rd.read_jsonl(MIXTURE)
                if not recs:
                    raise UserError(f"{self.rd.uri(MIXTURE)} is missing: the run's mixture schedule is unknown")
                srcs = recs[-1]["sources"]
                splits = [load_split(s["path"], f"data.train source {s['name']!r}", fmt=data.format) for s in srcs]
                plan = MixturePlan(splits, [s["name"] for s in srcs], compose(recs), seed=self.cfg.run.seed,
                                   global_batch=self.gb, shuffle=data.shuffle)
                self._plan = (plan, splits, [s["name"] for s in srcs])
            else:
                split = load_split(data.train, "data.train", fmt=data.format)
                self._plan = (SamplePlan.for_split(split, self.cfg.run.seed, self.gb, data.shuffle), [split], [None])
        return self._plan

    def position(self, step: int) -> int:
        """The data position of step `step`'s batch (1-based steps), from the surviving timeline's anchors."""
        reached = max([r.get("step", 0) for r in self.records] + [(self.rd.read_json(PROGRESS) or {}).get("step", 0)])
        if not 1 <= step <= reached:
            raise UserError(f"step {step}: the run {self.run_uri} reached step {reached}; trace a step in 1..{reached}")
        anchor = (1, 0)
        for r in self.records:
            if r.get("event") == "rollback" and r.get("skipped"):
                at = (int(r["step"]) + 1, int(r["skipped"][1]))
            elif "data_position" in r:
                at = (int(r["step"]), int(r["data_position"]))
            else:
                continue
            if at[0] <= step:
                anchor = at
        return anchor[1] + (step - anchor[0]) * self.gb

    def logged(self, step: int) -> Optional[dict]:
        """The surviving log record of `step`, if it was a log step."""
        got = [r for r in self.records if r.get("step") == step and "content_checksum" in r]
        return got[-1] if got else None

    def world_at(self, step: int) -> int:
        """Data-parallel ranks that trained `step` (the newest attempt that started before it)."""
        world = self.cfg.scaling.max_workers  # attempts.jsonl says the size each attempt trained at
        for a in self.rd.read_jsonl(ATTEMPTS):
            if int(a.get("resumed_step", 0)) < step and a.get("world_size"):
                world = int(a["world_size"])
        return max(1, world // max(1, self.cfg.deepspeed.tensor_parallel_size))

    def batch(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [global_batch, seq_len + 1] as trained, sample ids) of the global batch at data position
        `position`; ids of a mixture are source * ID_STRIDE + row (raytrain/data/mixture.py)."""
        from raytrain.data.mixed_reader import MixedReader
        from raytrain.data.reader import PlannedReader
        from raytrain.data.transforms import Transform

        plan, splits, _ = self.plan
        b = position // self.gb
        data = self.cfg.data
        if self.mixture:
            reader = MixedReader(plan, (0, self.gb), b, end_step=b + 1)
        else:
            transform = Transform(data.transform, data.transform_args, self.cfg.run.seed) if data.transform else None
            reader = PlannedReader(splits[0], plan, (0, self.gb), b, end_step=b + 1, transform=transform)
        try:
            rows, sp = reader.take(b)
        finally:
            reader.close()
        return rows, sp.ids


def documents(run: RunData, position: int, lanes: Optional[tuple[int, int]] = None) -> dict:
    """The documents of the global batch at `position` (lanes [lo, hi) of it, default all): per row its lane,
    sample id, source (a mixture's), and spans; with the content checksum of the whole batch as read."""
    from raytrain.data import content_checksum
    from raytrain.data.mixture import ID_STRIDE
    from raytrain.data.provenance import Provenance

    plan, splits, names = run.plan
    rows, ids = run.batch(position)
    lo, hi = lanes or (0, run.gb)
    provs: dict[int, Provenance] = {}
    out = []
    for lane in range(lo, hi):
        i, sid = (int(ids[lane] // ID_STRIDE), int(ids[lane] % ID_STRIDE)) if run.mixture else (0, int(ids[lane]))
        if i not in provs:
            provs[i] = Provenance(splits[i].uri, f"data.train source {names[i]!r}" if names[i] else "data.train")
        out.append({"lane": lane, **({"source_name": names[i]} if names[i] else {}), "sample_id": sid,
                    "spans": provs[i].spans(sid)})
    return {"position": int(position), "global_batch_index": int(position // run.gb),
            "content_checksum": content_checksum.of_batch(rows), "rows": out, "_tokens": rows}


def trace(run_uri: str, step: Optional[int], rank: Optional[int] = None, position: Optional[int] = None) -> dict:
    """`raytrain data trace`'s result for one step (rank: only that data-parallel rank's lanes), or for the global
    batch at a data position (a rollback's skipped bad batch, which no surviving step trained on)."""
    from raytrain.data.sample_plan import lanes_of

    run = RunData(run_uri)
    if position is not None:
        if position < 0 or position % run.gb:
            raise UserError(f"--position {position}: give a data position that starts a global batch (a multiple "
                            f"of {run.gb})")
        got = documents(run, position)
        got.update({"run": run.run_uri, "step": None, "world_size": None, "logged_content_checksum": None,
                    "checksum_matches": None})
        return got
    pos = run.position(step)
    world = run.world_at(step)
    lanes = None
    if rank is not None:
        if not 0 <= rank < world:
            raise UserError(f"--rank {rank}: step {step} was trained by {world} data-parallel rank(s); give 0..{world - 1}")
        lanes = lanes_of(run.gb, rank, world)
    got = documents(run, pos, lanes)
    logged = run.logged(step)
    got.update({"run": run.run_uri, "step": step, "world_size": world, **({"rank": rank} if rank is not None else {}),
                "logged_content_checksum": logged.get("content_checksum") if logged else None})
    got["checksum_matches"] = None if logged is None else got["logged_content_checksum"] == got["content_checksum"]
    return got


def render(t: dict) -> str:
    """A trace as text: one block per row, one line per document span."""
    lines = [f"run {t['run']} " + (f"step {t['step']}: " if t["step"] else "") + f"data position {t['position']} "
             f"(global batch {t['global_batch_index']})"
             + (f", {t['world_size']} data-parallel rank(s)" if t["world_size"] else "")
             + (f", rank {t['rank']}'s lanes" if "rank" in t else ""),
             f"content checksum {t['content_checksum']}: " + (
                 "logged at this step, equal" if t["checksum_matches"] else
                 "not a log step (no logged checksum to compare)" if t["checksum_matches"] is None else
                 f"DIFFERS from the logged {t['logged_content_checksum']}")]
    for r in t["rows"]:
        lines.append(f"lane {r['lane']}: " + (f"source {r['source_name']} " if "source_name" in r else "")
                     + f"sample {r['sample_id']}")
        for s in r["spans"]:
            lines.append(f"  [{s['pos']}:{s['pos'] + s['len']}] {s['source']}@{s['record']} tokens "
                         f"{s['doc_start']}..{s['doc_start'] + s['len'] - 1} of {s['tokens']}: {s['head'][:60]!r}")
    return "\n".join(lines)
