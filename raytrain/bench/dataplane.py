"""Bench part `dataplane`: the sample plan alone (no data) at cluster scale - read amplification and per-worker cost vs N."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from raytrain.data.plan import SamplePlan, units_of

TOKENS = 2049          # a 2048-token context plus the shifted target
ROW_BYTES = TOKENS * 4  # int32 token ids, as `raytrain prepare` writes them
UNIT_ROWS = 1024
CORPUS_BYTES = 10 ** 12


def simulate(plan: SamplePlan, world: int, epoch: int = 0, probe_steps: int = 64) -> dict:
    """One epoch of `plan` at `world` ranks, each rank reading every unit its lanes touch once, whole."""
    L, gb = plan.steps_per_epoch, plan.global_batch
    per = gb // world
    order, starts = plan.epoch_order(epoch)
    rows = plan.unit_rows[order]
    end = np.minimum(starts + rows, plan.trained_per_epoch)
    used = starts < plan.trained_per_epoch  # the epoch's untrained tail is read by nobody
    first = starts[used] // L // per
    last = (end[used] - 1) // L // per
    ranks = last - first + 1
    read = int((rows[used] * ranks).sum())
    opens = np.zeros(world + 1, np.int64)  # units each rank opens over the epoch (a difference array)
    np.add.at(opens, first, 1)
    np.add.at(opens, last + 1, -1)
    opens = np.cumsum(opens)[:world]
    rng = np.random.default_rng(0)
    held, t_plan = 0, 0.0
    for s in rng.integers(0, L, probe_steps):  # units rank r holds at once: one per lane, at random steps
        lanes = plan.lanes_of(int(rng.integers(world)), world)
        t = time.perf_counter()
        units = plan.step(epoch * L + int(s), lanes).units
        t_plan += time.perf_counter() - t
        held = max(held, len(np.unique(units)))
    return {"read_amplification": read / plan.trained_per_epoch, "units_per_worker_step": float(opens.max()) / L,
            "cache_units": held, "cache_mb": held * UNIT_ROWS * ROW_BYTES / 2 ** 20,
            "ranks_per_unit_mean": float(ranks.mean()), "ranks_per_unit_max": int(ranks.max()),
            "plan_us_per_step": 1e6 * t_plan / probe_steps}


def dataplane(log: Callable = print, workers=(8, 64, 512, 1024), batches=(512, 1024, 2048, 4096),
              corpus_bytes: int = CORPUS_BYTES) -> list[dict]:
    from raytrain.bench.parts import figure

    n_units = corpus_bytes // (ROW_BYTES * UNIT_ROWS)
    t = time.perf_counter()
    units = units_of([UNIT_ROWS] * n_units)
    log(f"   synthetic manifest: {corpus_bytes / 1e12:g} TB = {n_units * UNIT_ROWS:,} rows of {TOKENS} tokens in "
        f"{n_units:,} units of {UNIT_ROWS} rows ({UNIT_ROWS * ROW_BYTES / 2**20:.1f} MiB); built in {time.perf_counter() - t:.1f}s")
    log(f"   {'N':>5} {'gb':>5} {'read ampl.':>10} {'units/worker/step':>17} {'cache/worker':>18} "
        f"{'ranks/unit mean,max':>19} {'plan us/step':>12}")
    out = []
    for gb in batches:
        plan = SamplePlan(units, [UNIT_ROWS] * n_units, seed=0, global_batch=gb)
        for n in workers:
            if gb < n or gb % n:
                log(f"   {n:>5} {gb:>5}  n/a: a global batch of {gb} sequences cannot give each of {n} workers an equal share")
                continue
            r = simulate(plan, n)
            log(f"   {n:>5} {gb:>5} {r['read_amplification']:>10.4f} {r['units_per_worker_step']:>17.4f} "
                f"{r['cache_units']:>6} units {r['cache_mb']:>6.0f} MiB "
                f"{r['ranks_per_unit_mean']:>13.4f},{r['ranks_per_unit_max']:>2} {r['plan_us_per_step']:>12.0f}")
            out.append(figure("dataplane", f"read amplification, N={n}, gb={gb}", r["read_amplification"], "x",
                              "SampleStream: every worker reads the global stream", float(n), "<= 1.1",
                              met=r["read_amplification"] <= 1.1, workers=n, global_batch=gb, **r))
    return out


def runs(tmp: str, log: Callable = print, workers=(1, 2, 4), steps: int = 0) -> list[dict]:
    """Real training runs under the plan (tiny model, CPU): read amplification, bytes fetched and data wait from
    the run's own counters (summary.json), one epoch of python-docs in 8-row shards (~190 units), global batch 16."""
    from raytrain.bench.parts import figure
    from raytrain.config import load_config
    from raytrain.data.manifest import load_split
    from raytrain.data.plan import SamplePlan
    from raytrain.trainer import train

    import os

    from raytrain.data.prepare import PrepareConfig, prepare

    data = f"{tmp}/dp-data"
    if not os.path.exists(f"{data}/train/manifest.json"):
        prepare(PrepareConfig(inputs=["python-docs"], out=data, max_chars=400_000, seq_len=64, shard_rows=8,
                              formats=["parquet", "webdataset"], engine="local"), log=lambda *_: None)
    split = load_split(f"{data}/train")
    plan = SamplePlan.for_split(split, 0, 16)
    steps = steps or plan.steps_per_epoch
    log(f"   {len(split.shard_uris)} units of {max(split.shard_rows)} rows, {split.num_samples} rows; {steps} steps "
        f"of global batch 16 = {'one epoch' if steps == plan.steps_per_epoch else f'{steps} steps'}")
    out = []
    for fmt in ("parquet", "webdataset"):
        for n in workers if fmt == "parquet" else (2,):
            cfg = load_config("tiny", [
                f"data.train={data}/train", "data.val=null", f"data.format={fmt}", f"checkpoint.storage={tmp}/dp-runs",
                f"run.name=dp-{fmt}-{n}", f"scaling.num_workers={n}", f"run.max_steps={steps}", "run.log_every=20",
                "run.eval_every=0", "checkpoint.every_n_steps=100000", "checkpoint.save_final=false",
                "run.max_failures=0", "model.n_layer=1", "model.hidden_size=32", "model.n_head=2", "model.seq_len=64",
                "batch.micro_batch_size=4", "batch.gradient_accumulation_steps=null", "batch.global_batch_size=16"])
            s = train(cfg, log=lambda *_: None)
            log(f"   {fmt:10} N={n}: read amplification {s['read_amplification']:.3f} | rows read/worker "
                f"{s['data_rows_read_per_worker']:.0f} (max {s['data_rows_read_max']:.0f}) for "
                f"{s['data_rows_trained_per_worker']:.0f} trained | bytes fetched/worker "
                f"{s['data_bytes_fetched_per_worker'] / 1e3:.0f} kB | data wait mean {s['data_wait_frac_mean']:.2%}, "
                f"max {s['data_wait_frac_max']:.2%} | {s['tokens_per_s']:,.0f} tokens/s")
            out.append(figure("dataplane", f"measured read amplification, {fmt}, N={n}", s["read_amplification"], "x",
                              "SampleStream: every worker reads the global stream", float(n), "<= 1.25",
                              met=s["read_amplification"] <= 1.25, workers=n, format=fmt,
                              **{k: v for k, v in s.items() if k.startswith("data_")}))
    return out
