"""The sweep driver: check the spec, connect to Ray, size trial concurrency from the cluster, run (or restore)
the Tune experiment, then write the results. `raytrain tune` calls run_sweep."""

from __future__ import annotations

from typing import Callable

from raytrain import storage
from raytrain.config import Config
from raytrain.errors import UserError
from raytrain.sweep.spec import SweepSpec, base_config, microbatch_grid, trial_config


def sweep_dir(spec: SweepSpec) -> str:
    root = spec.storage or storage.join(base_config(spec).checkpoint.storage, "sweeps")
    return storage.join(storage.absolute(root), spec.name)


def anchored(spec: SweepSpec) -> SweepSpec:
    """Local paths made absolute here: Tune runs each trial in its own working directory."""
    probe = trial_config(spec, {})
    extra = {k: storage.absolute(v) for k, v in (("data.train", probe.data.train), ("data.val", probe.data.val))
             if isinstance(v, str)}  # a mixture's source paths: as given (absolute paths recommended)
    base = spec.base
    if base.endswith((".yaml", ".yml")) or "/" in base:
        base = storage.absolute(base)
    return spec.model_copy(update={"base": base, "overrides": {**spec.overrides, **extra}})


def concurrency(cfg: Config, spec: SweepSpec, cluster: dict) -> int:
    """Trials that fit at once: each needs its workers' resources plus Ray Data's CPUs (a trial holding every CPU starves its own data pipeline) plus
    its driver. More would only start Train runs that wait for each other's resources."""
    if spec.search.method == "microbatch":
        return 1  # throughput is measured: trials must not share the machine (and each depends on the last)
    s = cfg.scaling
    need = {"CPU": s.num_workers * s.cpus_per_worker + s.data_cpus + spec.resources.driver_cpus}
    if s.use_gpu:
        need["GPU"] = s.num_workers * s.gpus_per_worker
    need.update({k: v * s.num_workers for k, v in s.resources_per_worker.items()})
    fit = min(int(cluster.get(k, 0.0) // v) if v else 10**6 for k, v in need.items())
    n = max(1, fit)  # on an autoscaling cluster one trial can always wait for nodes
    return min(n, spec.resources.max_concurrent) if spec.resources.max_concurrent else n


def _trial_dirname(trial) -> str:
    return trial.trial_id


def run_sweep(spec: SweepSpec, resume: bool = False, log: Callable[[str], None] = print) -> dict:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search import BasicVariantGenerator

    from raytrain.sweep.results import rows_from, table, write_all
    from raytrain.sweep.space import MicroBatchSearcher, param_space
    from raytrain.sweep.trial import make_trainable
    from raytrain.trainer import check_inputs, init_ray

    spec = anchored(spec)
    probe = trial_config(spec, {})
    check_inputs(probe)  # data present and matching before any trial starts
    sdir = sweep_dir(spec)
    storage.check_writable(sdir)
    root, fs = storage.ray_storage(sdir.rsplit("/", 1)[0])
    exp_path = f"{root}/{spec.name}"
    started = init_ray(probe, "tune")
    try:
        exists = tune.Tuner.can_restore(exp_path, storage_filesystem=fs)
        if resume and not exists:
            raise UserError(f"nothing to resume: no sweep state under {sdir} (run it without --resume first)")
        if exists and not resume:
            raise UserError(f"sweep {spec.name} already exists at {sdir}: continue it with --resume, or set name=...")
        n = concurrency(probe, spec, ray.cluster_resources())
        trainable = make_trainable(spec, sdir)
        if resume:
            log(f"[raytrain] resuming sweep {spec.name} from {sdir}")
            tuner = tune.Tuner.restore(exp_path, trainable, resume_unfinished=True, storage_filesystem=fs)
        else:
            method, sched = spec.search.method, spec.scheduler
            if method == "microbatch":
                grid = microbatch_grid(spec)
                search_alg, space, samples = MicroBatchSearcher.from_spec(spec), {}, len(grid)
                log(f"[raytrain] sweep {spec.name}: micro-batch over {grid} (global batch {probe.global_batch} "
                    f"fixed), one trial at a time, stop on a <{spec.microbatch.plateau_pct}% gain or memory")
            else:
                # The variant generator enforces its own limit (Tune ignores max_concurrent_trials for it).
                search_alg = BasicVariantGenerator(random_state=spec.search.seed, max_concurrent=n)
                space, samples = param_space(spec), spec.budget.num_samples
                log(f"[raytrain] sweep {spec.name}: {method} search, {samples} sample(s) of {', '.join(spec.space)}; "
                    f"{n} trial(s) at a time ({probe.scaling.num_workers} workers + {probe.scaling.data_cpus:g} "
                    f"data CPUs each)")
            scheduler = (ASHAScheduler(time_attr="step", max_t=probe.run.max_steps, grace_period=sched.grace_period,
                                       reduction_factor=sched.reduction_factor)
                         if sched.type == "asha" else FIFOScheduler())
            tuner = tune.Tuner(
                trainable, param_space=space,
                tune_config=tune.TuneConfig(metric=spec.objective.metric, mode=spec.mode, search_alg=search_alg,
                                            scheduler=scheduler, num_samples=samples,
                                            max_concurrent_trials=n if method == "microbatch" else None,
                                            reuse_actors=False, trial_dirname_creator=_trial_dirname),
                run_config=tune.RunConfig(name=spec.name, storage_path=root, storage_filesystem=fs, verbose=1),
            )
        grid_result = tuner.fit()
    finally:
        if started:
            ray.shutdown()
    rows = rows_from(grid_result, spec)
    out = write_all(rows, spec, sdir)
    log(table(rows, spec))
    if "microbatch" in out:
        mb = out["microbatch"]
        log(f"[raytrain] micro-batch search used {mb['trials_used']} of {mb['grid_size']} grid points; "
            f"stopped: {mb['stop_reason']}")
    if out["best"]:
        b = out["best"]
        log(f"[raytrain] best: trial {b['trial']} {', '.join(f'{k}={v}' for k, v in b['settings'].items())} "
            f"-> {spec.objective.metric}={b[spec.objective.metric]:.6g}")
        log(f"[raytrain] best config: {out['best_config']}  (raytrain train --config {out['best_config']})")
    else:
        log("[raytrain] no trial completed: see the table above")
    log(f"[raytrain] results: {storage.join(sdir, 'results.csv')}, {storage.join(sdir, 'results.json')}")
    return out
