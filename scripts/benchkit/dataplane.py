"""Bench part `dataplane`: the sample plan alone (no data) at cluster scale - read amplification and per-worker cost vs N."""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from raytrain.data.sample_plan import SamplePlan, units_of

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
    from benchkit.parts import figure  # no baseline here: N (the read amplification before the plan) is a constant

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
                              target="<= 1.1", reference=f"before the plan: {n} (every worker read the global stream)",
                              met=r["read_amplification"] <= 1.1, workers=n, global_batch=gb, **r))
    return out


# Mixtures simulated: weights and the share of the corpus bytes each source holds (different sizes, so the
# small, heavily weighted sources repeat within an epoch of the large ones).
MIXTURES = {2: ((0.8, 0.2), (0.9, 0.1)),
            8: ((0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.04, 0.03), (0.4, 0.25, 0.1, 0.1, 0.05, 0.05, 0.03, 0.02))}


def simulate_source(plan, i: int, world: int) -> dict:
    """One epoch of source i's plan in stage 0 at `world` ranks, each rank reading every unit its slots touch."""
    from raytrain.data.mixture import MixturePlan

    assert isinstance(plan, MixturePlan)
    st, sub = plan.stages[0], plan.source_plan(i, 0)
    L, per = sub.steps_per_epoch, plan.global_batch // world
    order, starts = sub.epoch_order(0)
    rows = sub.unit_rows[order]
    end = np.minimum(starts + rows, sub.trained_per_epoch)
    used = starts < sub.trained_per_epoch
    first = (starts[used] // L + st.base[i]) // per  # the rank of the unit's first and last lane
    last = ((end[used] - 1) // L + st.base[i]) // per
    ranks = last - first + 1
    trained = int(plan.counts(0, L)[i])  # slots the source fills over the epoch (boundary lanes: part of the time)
    return {"read_amplification": float((rows[used] * ranks).sum()) / trained, "lanes": int(st.lanes[i]),
            "slots_per_batch": float(st.weights[i] * plan.global_batch), "ranks_per_unit_max": int(ranks.max())}


def mixture_figures(log: Callable = print, sources=(2, 8), workers=(8, 64, 512, 1024), batches=(512, 1024, 2048),
                    corpus_bytes: int = CORPUS_BYTES) -> list[dict]:
    """Mixtures of 2 and 8 sources of different sizes: the worst source's read amplification at each N."""
    from benchkit.parts import figure
    from raytrain.data.manifest import Split
    from raytrain.data.mixture import MixturePlan

    n_units = corpus_bytes // (ROW_BYTES * UNIT_ROWS)
    out = []
    log(f"   {'K':>2} {'N':>5} {'gb':>5} {'worst source read ampl.':>24} {'its slots/batch':>15} {'all sources':>40}")
    for k in sources:
        weights, sizes = MIXTURES[k]
        splits = [Split(uri=f"sim{j}", shard_uris=(), shard_rows=tuple([UNIT_ROWS] * max(1, int(n_units * f))),
                        seq_len=TOKENS - 1, vocab_size=1, eot_id=0, tokenizer_uri="") for j, f in enumerate(sizes)]
        for gb in batches:
            plan = MixturePlan(splits, [f"s{j}" for j in range(k)], [(0, weights)], seed=0, global_batch=gb)
            for n in workers:
                if gb < n or gb % n:
                    continue
                per = [simulate_source(plan, j, n) for j in range(k)]
                worst = max(per, key=lambda r: r["read_amplification"])
                log(f"   {k:>2} {n:>5} {gb:>5} {worst['read_amplification']:>24.4f} {worst['slots_per_batch']:>15.1f} "
                    + " ".join(f"{r['read_amplification']:.3f}" for r in per))
                out.append(figure("dataplane", f"mixture of {k}: worst source's read amplification, N={n}, gb={gb}",
                                  worst["read_amplification"], "x", target="<= 1.1",
                                  reference="ideal: 1.0 (every row read once)",
                                  met=worst["read_amplification"] <= 1.1, workers=n, global_batch=gb, sources=k,
                                  per_source=[r["read_amplification"] for r in per]))
    return out


def runs(tmp: str, log: Callable = print, workers=(1, 2, 4), steps: int = 0, s3: Optional[str] = None,
         quick: bool = False) -> list[dict]:
    """Real training runs under the plan (tiny model, CPU), one epoch of python-docs in 8-row shards (~190 units),
    global batch 16, for Parquet and WebDataset, from local disk and (given `s3`) an S3-protocol server: read
    amplification, rows and bytes read per worker against what it trained on, and data wait, from the run's
    own counters (summary.json). --quick: local only."""
    import json
    import os

    from raytrain import storage
    from benchkit.parts import figure
    from raytrain.config import load_config
    from raytrain.data.manifest import load_split
    from raytrain.data.sample_plan import SamplePlan
    from raytrain.data.prepare import PrepareConfig, prepare
    from raytrain.trainer import train

    data = f"{tmp}/dp-data"
    if not os.path.exists(f"{data}/train/manifest.json"):
        prepare(PrepareConfig(inputs=["python-docs"], out=data, max_chars=400_000, seq_len=64, shard_rows=8,
                              formats=["parquet", "webdataset"], engine="local"), log=lambda *_: None)
    wheres = {"local": data}
    if s3 and not quick:
        storage.upload_dir(data, s3)
        wheres["s3"] = s3
    split = load_split(f"{data}/train")
    plan = SamplePlan.for_split(split, 0, 16)
    steps = steps or plan.steps_per_epoch
    manifest = json.loads(storage.read_text(f"{data}/train/manifest.json"))
    log(f"   {len(split.shard_uris)} units of {max(split.shard_rows)} rows, {split.num_samples} rows; {steps} steps "
        f"of global batch 16 = {'one epoch' if steps == plan.steps_per_epoch else f'{steps} steps'}")
    log(f"   {'where':6} {'format':10} {'N':>2} {'read amp':>8} {'rows read/worker (max)':>22} {'trained':>7} "
        f"{'bytes/worker':>12} {'bytes/trained-bytes':>19} {'wait mean':>9} {'wait max':>8}")
    out = []
    for where, base in wheres.items():
        for fmt in ("parquet", "webdataset"):
            unit_bytes = sum(s["bytes"] for s in manifest["shards"][fmt])
            for n in workers:
                cfg = load_config("tiny", [
                    f"data.train={base}/train", "data.val=null", f"data.format={fmt}",
                    f"checkpoint.storage={tmp}/dp-runs", f"run.name=dp-{where}-{fmt}-{n}", f"scaling.num_workers={n}",
                    f"run.max_steps={steps}", "run.log_every=20", "run.eval_every=0", "checkpoint.every_n_steps=100000",
                    "checkpoint.save_final=false", "run.max_failures=0", "model.n_layer=1", "model.hidden_size=32",
                    "model.n_head=2", "model.seq_len=64", "batch.micro_batch_size=4",
                    "batch.gradient_accumulation_steps=null", "batch.global_batch_size=16"])
                s = train(cfg, log=lambda *_: None)
                trained = s["data_rows_trained_per_worker"]
                # Against the bytes of the units a worker trained on: its share of the split's bytes.
                byte_ratio = s["data_bytes_fetched_per_worker"] / (unit_bytes * trained / split.num_samples)
                log(f"   {where:6} {fmt:10} {n:>2} {s['read_amplification']:>8.3f} "
                    f"{s['data_rows_read_per_worker']:>14.0f} ({s['data_rows_read_max']:>5.0f}) {trained:>7.0f} "
                    f"{s['data_bytes_fetched_per_worker'] / 1e3:>9.0f} kB {byte_ratio:>19.3f} "
                    f"{s['data_wait_frac_mean']:>9.2%} {s['data_wait_frac_max']:>8.2%}")
                out.append(figure("dataplane", f"measured read amplification, {where}, {fmt}, N={n}",
                                  s["read_amplification"], "x", target="<= 1.25",
                                  reference=f"before the plan: {n} (every worker read the global stream)",
                                  met=s["read_amplification"] <= 1.25, workers=n, format=fmt, where=where,
                                  bytes_per_trained_byte=byte_ratio,
                                  **{k: v for k, v in s.items() if k.startswith("data_")}))
    return out
