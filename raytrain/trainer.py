"""Driver side of `raytrain train`: check inputs, connect to Ray, build the TorchTrainer, report the result.

Everything that can be checked before workers start (config, data, storage, cluster size) is checked
here, so bad input fails in a second with one line instead of after a cluster spin-up.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Optional

import numpy as np

from raytrain import faults, micro_batch, storage
from raytrain.config import Config
from raytrain.data import sources, transforms
from raytrain.data.reader import read_unit
from raytrain.data.sample_plan import units_of
from raytrain.data.manifest import Split, load_split
from raytrain.errors import UserError
from raytrain.internals.ray import set_worker_poll_s
from raytrain.rundir import COMM_FAILURE, CONFIG, GOODPUT, RunDir
from raytrain.worker.runlog import read_summary

HEALTH_CHECK_INTERVAL_S = 0.5  # Ray Train's worker poll (default 2 s): fault detection and the end of a run


def check_inputs(cfg: Config) -> tuple[Split, Optional[Split]]:
    if not cfg.data.train:
        raise UserError("data.train is not set: pass data.train=<prepared dataset>/train (see `raytrain prepare`)")
    deep = cfg.data.verify == "checksum"
    fmt = cfg.data.format
    if sources.is_mixture(cfg.data):
        splits, vals = sources.load_sources(cfg.data, checksums=deep)
        named = [(f"data.train source {s.name!r}", sp) for s, sp in zip(cfg.data.train, splits)]
        named += [(f"data.train source {n!r} val", sp) for n, sp in vals.items()]
        train = splits[0]  # vocabulary, end-of-text id, packing: one for all (checked); sizes: by the plan
    else:
        train = load_split(cfg.data.train, "data.train", checksums=deep, fmt=fmt)
        named = [("data.train", train)]
        transforms.check(cfg.data, train, cfg.run.seed, lambda: read_unit(train, units_of(train.shard_rows)[0],
                                                                          dtype=np.int32))
    val = load_split(cfg.data.val, "data.val", checksums=deep, fmt=fmt) if cfg.data.val else None
    for name, split in named + [("data.val", val)]:
        if split is None:
            continue
        if split.seq_len != cfg.model.seq_len:
            raise UserError(f"{name} was packed for seq_len={split.seq_len} but model.seq_len={cfg.model.seq_len}; "
                            f"set model.seq_len={split.seq_len} or prepare the data again")
        if cfg.model.vocab_size is not None and cfg.model.vocab_size < split.vocab_size:
            raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than {name}'s tokenizer "
                            f"({split.vocab_size}); set model.vocab_size=null to take it from the data")
    vocab = cfg.model.vocab_size or train.vocab_size
    if val is not None and val.vocab_size > vocab:
        raise UserError(f"data.val's tokenizer has {val.vocab_size} tokens but the model has {vocab}; "
                        f"prepare both splits with the same tokenizer")
    mb = cfg.batch.micro_batch_size
    if sources.is_mixture(cfg.data):
        return train, val
    if mb != "auto" and mb > train.num_samples:
        raise UserError(f"batch.micro_batch_size={mb} is larger than data.train ({train.num_samples} sequences); "
                        f"use batch.micro_batch_size<={train.num_samples}")
    if cfg.global_batch > train.num_samples:
        raise UserError(f"global batch {cfg.global_batch} (micro_batch x accumulation x workers) is larger than "
                        f"data.train ({train.num_samples} sequences); lower batch.* or scaling.num_workers")
    if cfg.model.lora.r:
        from raytrain.lora import check_targets

        check_targets(cfg.model, vocab)  # names that match no module fail here, not on every worker
    return train, val


def _mixture(cfg: Config, log: Callable) -> tuple[Optional[dict], Optional[dict]]:
    """A mixture's plan for the workers (its schedule recorded in the run directory) and its sources' val
    splits; (None, None) for a single split."""
    if not sources.is_mixture(cfg.data):
        return None, None
    from raytrain.ckpt import catalog

    info = catalog.latest_complete(cfg.run_uri)
    splits, vals = sources.load_sources(cfg.data)
    mixture = sources.plan_mixture(cfg, splits, info.step if info else 0)
    log("[raytrain] mixture " + ", ".join(f"{n} ({sp.num_samples:,} seqs)" for n, sp in zip(mixture["names"], splits))
        + " | stages " + "; ".join(f"from step {s}: " + " ".join(f"{w:.3g}" for w in ws) for s, ws in mixture["stages"]))
    return mixture, {n: v.to_dict() for n, v in vals.items()} or None


def reader_for(cfg: Config) -> str:
    """data.reader=auto: the Ray Data pipeline where CPU-only data nodes take its work, else the direct reader."""
    from raytrain.data.ingest import has_data_nodes

    if sources.is_mixture(cfg.data):
        return "direct"  # (the ray reader takes one source)
    return "ray" if has_data_nodes() else "direct"


def init_ray(cfg: Config, command: str = "train") -> bool:
    """Connect to (or start) Ray as raytrain.ray_connect says. True when raytrain started a private local instance."""
    from raytrain.ray_connect import connect

    # A local instance's logical CPUs cover the workers (an elastic run's MAX) and scaling.data_cpus (the readers'
    # threads, uploads).
    need = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker + cfg.scaling.data_cpus
    return connect(command, cfg.scaling.address, local_cpus=need)


def check_resume_compatible(cfg: Config) -> Config:
    """Before any worker starts: find the checkpoint this run resumes from and keep its global batch.

    Resuming with another number of workers is supported (the engine state is resharded through
    DeepSpeed's universal checkpoint format); the global batch is held by recomputing accumulation,
    so the data position and the optimisation trajectory mean the same thing as before.
    """
    from raytrain.ckpt import catalog

    info = catalog.latest_complete(cfg.run_uri)
    if info is None:
        return cfg
    manifest = catalog.read_manifest(info.uri)
    wrote, old_gb = manifest.get("world_size"), manifest.get("global_batch")
    print(f"[raytrain] resuming run {cfg.run.name} from {info.uri} (step {info.step}, {wrote} workers)", flush=True)
    if not old_gb or old_gb == cfg.global_batch:
        return cfg
    if cfg.scaling.elastic:
        raise UserError(f"run {cfg.run.name} was trained with a global batch of {old_gb} sequences; an elastic run "
                        f"keeps its global batch at every size: set batch.global_batch_size={old_gb}")
    dp = cfg.data_parallel_size  # tensor-parallel ranks share a batch: only data-parallel ranks add to it
    per_step = cfg.batch.micro_batch_size * dp
    if old_gb % per_step:
        raise UserError(f"run {cfg.run.name} was trained with a global batch of {old_gb} sequences; with "
                        f"{dp} data-parallel workers x micro_batch_size {cfg.batch.micro_batch_size} it cannot be "
                        f"kept (not a multiple of {per_step}); choose batch.micro_batch_size dividing "
                        f"{old_gb // dp if old_gb % dp == 0 else 'it'}")
    acc = old_gb // per_step
    print(f"[raytrain] keeping the run's global batch of {old_gb}: gradient_accumulation_steps "
          f"{cfg.accumulation} -> {acc} for {dp} data-parallel workers", flush=True)
    batch = cfg.batch.model_copy(update={"gradient_accumulation_steps": acc, "global_batch_size": None})
    return cfg.model_copy(update={"batch": batch})


def check_integrations(cfg: Config) -> None:
    """Optional extras the config asks for, checked at submit: one line now, not a warning from every worker (a
    tracker) or a failed evaluation much later (a task name, the harness)."""
    from raytrain.worker.trackers import check_installed

    check_installed(cfg)
    if cfg.eval.tasks:
        from raytrain.eval_harness import check_tasks

        check_tasks(cfg.eval.tasks, cfg.eval.include_path)


def check_cluster(cfg: Config, local: bool) -> None:
    """Resources the run needs that this cluster lacks: an error on our own local instance (nothing will
    ever add them), a warning on a real cluster (its autoscaler may)."""
    import ray

    from raytrain.data.ingest import has_data_nodes

    res = ray.cluster_resources()
    s = cfg.scaling
    least = min(cfg.sizes())  # an elastic run starts at any usable size: its smallest is what it cannot do without
    wanted = {"GPU": least * s.gpus_per_worker} if s.use_gpu else {}
    wanted.update({k: v * least for k, v in s.resources_per_worker.items()})
    if cfg.data.reader == "ray" and not has_data_nodes() and cfg.data.ingest_resources is None:
        # the read tasks share the workers' nodes: one CPU beyond the workers' or none ever runs
        wanted["CPU"] = least * s.cpus_per_worker + 1
    for name, amount in wanted.items():
        if res.get(name, 0) < amount:
            msg = (f"the run needs {amount:g} {name} ({least} workers"
                   f"{', and data.reader=ray its read tasks' if name == 'CPU' else ''}) but the cluster has "
                   f"{res.get(name, 0):g}")
            if local:
                raise UserError(msg + ("; set scaling.use_gpu=false or run on a GPU machine" if name == "GPU" else
                                       "; lower scaling.cpus_per_worker or set data.reader=direct" if name == "CPU"
                                       else "; remove it from scaling.resources_per_worker or use a cluster that has it"))
            print(f"[raytrain] warning: {msg}; waiting for the autoscaler", flush=True)
    if len([n for n in ray.nodes() if n.get("Alive")]) > 1 and not storage.is_remote(cfg.checkpoint.storage):
        print(f"[raytrain] warning: checkpoint.storage={cfg.checkpoint.storage} is a local path on a multi-node "
              "cluster; each node writes its own part there, so use shared storage (s3://... or an NFS mount)",
              flush=True)
    if cfg.deepspeed.offload_optimizer != "none" and s.use_gpu and s.cpus_per_worker < 4:
        # The offloaded Adam step runs on the worker's own CPU threads, which are cpus_per_worker.
        print(f"[raytrain] warning: deepspeed.offload_optimizer={cfg.deepspeed.offload_optimizer} runs the optimizer "
              f"step on {s.cpus_per_worker:g} CPU thread(s) per worker (scaling.cpus_per_worker); give each GPU "
              "worker more, e.g. scaling.cpus_per_worker=8, or the step will wait on the CPU", flush=True)
    total = res.get("CPU", 0)
    workers = least * cfg.scaling.cpus_per_worker
    if total < workers:
        # Not an error: on an autoscaling cluster the nodes come, and Ray Train waits for them.
        print(f"[raytrain] warning: the cluster has {total:g} CPUs now; the {least} workers need "
              f"{workers:g} (scaling.num_workers x scaling.cpus_per_worker). Waiting for the autoscaler; without "
              "one, lower those settings or add nodes.", flush=True)
    elif total < workers + cfg.scaling.data_cpus:
        print(f"[raytrain] warning: the cluster has {total:g} CPUs; after the workers' {workers:g}, fewer than "
              f"scaling.data_cpus={cfg.scaling.data_cpus:g} are left for the data readers and checkpoint uploads, "
              "so steps may wait on them (the run logs data_wait_frac).", flush=True)


def _root_user_error(err: BaseException) -> Optional[str]:
    """Find a UserError (or a collective's diagnosis) raised inside a worker, so the CLI can print its one line."""
    text = str(err)
    for marker in ("UserError: ", "CommunicationError: "):
        if marker in text:
            return text.split(marker, 1)[1].strip().splitlines()[0]
    cause = err.__cause__ or err.__context__
    return _root_user_error(cause) if cause else None


def _capacity_timeout(err: BaseException):
    """The CapacityTimeout that ended the controller, if that is what `err` is."""
    from raytrain.errors import CapacityTimeout

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        cause = getattr(err, "controller_failure", None)
        if isinstance(cause, CapacityTimeout):
            return cause
        if isinstance(err, CapacityTimeout):
            return err
        err = cause or err.__cause__ or err.__context__
    return None


def failure_line(err: BaseException, run_uri: str) -> Optional[str]:
    """The one line to print for a failed fit: our UserError from a worker, or an S3 refusal of Ray Train's own
    calls on the run storage (its controller creates the run directory with the worker node's role)."""
    msg = _root_user_error(err)
    denied = storage.access_denied(run_uri, err) if msg is None else None
    return str(denied) if denied is not None else msg


def optimizer_named(cfg: Config) -> str:
    """The optimizer and learning rate the engine gets: optim.* unless deepspeed.extra names its own."""
    extra = cfg.deepspeed.extra.get("optimizer") or {}
    return f"{extra.get('type', 'AdamW')} lr {(extra.get('params') or {}).get('lr', cfg.optim.lr):g}"


def train(cfg: Config, log: Callable[[str], None] = print, inject: Optional[dict] = None,
          callbacks: Optional[list] = None, submitted: Optional[dict] = None) -> dict:
    """Run (or resume) a training run to run.max_steps. Returns the run's summary.json contents.

    `inject` is the fault-injection hook (see raytrain/faults.py), for tests and chaos drills; a job
    submitted with `ray job submit` can pass it as JSON in RAYTRAIN_FAULT_INJECT.
    `callbacks` are Ray Train callbacks for the run, e.g. Tune's TuneReportCallback when the run is a
    sweep trial (raytrain.sweep): every metrics report of the workers then reaches the Tune trial.
    `submitted` is what the user asked for ({"recipe", "overrides"}), kept in the run's audit records.
    """
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain.elastic.policy import trainer_class
    from raytrain.model import apply_init_from
    from raytrain.restart_phases import make_clock
    from raytrain.worker.loop import train_loop_per_worker

    t_submit = time.time()  # the goodput ledger's first second (raytrain/goodput.py)
    cfg.storage.apply()  # encryption of object traffic and objects, before the first S3 call and every Ray process
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
        update={"storage": storage.absolute(cfg.checkpoint.storage)})})
    train_split, val_split = check_inputs(cfg)
    check_integrations(cfg)
    cfg = apply_init_from(cfg, train_split.tokenizer_uri, log)  # fine-tuning: shape from the model dir
    storage.check_writable(cfg.run_uri)
    local = init_ray(cfg)
    if cfg.data.reader == "auto":
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"reader": reader_for(cfg)})})
    check_cluster(cfg, local)
    if cfg.batch.micro_batch_size == "auto":  # the largest that fits a worker (raytrain/micro_batch.py)
        cfg = micro_batch.resolve(cfg, vocab=cfg.model.vocab_size or train_split.vocab_size,
                                  memory_mb=micro_batch.worker_memory_mb(cfg), log=log)
    cfg = check_resume_compatible(cfg)
    say_batch(cfg, cfg.model.vocab_size or train_split.vocab_size, log)
    o = cfg.optim
    mixture, val_sources = _mixture(cfg, log)
    log(f"[raytrain] data {train_split.num_samples:,} x {train_split.seq_len} tokens ({train_split.format}, "
        f"{len(train_split.shard_uris)} shards, reader {cfg.data.reader}) from {train_split.uri}"
        f"{' and the other sources' if mixture else ''}"
        + (f", val {val_split.num_samples:,}" if val_split else ", no validation")
        + f" | {cfg.run.max_steps} steps, {optimizer_named(cfg)} warmup {o.warmup_steps} {o.decay}, "
          f"clip {o.grad_clip:g}")
    storage.write_text(RunDir(cfg.run_uri).uri(CONFIG), cfg.to_yaml())
    audit_submit(cfg, submitted)
    s = cfg.scaling
    resources = s.worker_resources
    storage_path, fs = storage.ray_storage(cfg.checkpoint.storage)
    # Ray Train's controller polls the workers every 2 s by default, and a dead worker, like the end of every
    # run, waits for the next poll; 0.5 s costs it a few small actor calls a second (docs/FAULT_TOLERANCE.md).
    # Ray passes the driver's value on to the controller; one set by the user wins.
    set_worker_poll_s(HEALTH_CHECK_INTERVAL_S)
    clock = make_clock(cfg.run_uri)  # a restart's phases, for attempts.jsonl (None where Ray's internals differ)
    # Two budgets: a spot run expects many preemptions but few real failures.
    failure_config = FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=cfg.run.max_preemptions)
    trainer_cls, num_workers = trainer_class(cfg, TorchTrainer, failure_config)
    trainer = trainer_cls(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "elastic": cfg.scaling.elastic, "train_split": train_split.to_dict(),
                           "val_split": val_split.to_dict() if val_split else None,
                           "mixture": mixture, "val_sources": val_sources,
                           "inject": inject if inject is not None else faults.from_env()},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo", timeout_s=s.collective_timeout_s),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=s.use_gpu, resources_per_worker=resources,
                                     elastic_resize_monitor_interval_s=s.resize_monitor_s),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_path,
            storage_filesystem=fs,
            failure_config=failure_config,
            callbacks=[*(callbacks or ()), *([clock] if clock is not None else [])],
            logging_config=LoggingConfig(log_level="WARNING"),  # worker-group start/stop lines: Ray's logs only
            worker_runtime_env={"env_vars": worker_env()},
        ),
    )
    _fit(trainer, cfg, submitted=t_submit, log=log)
    summary = read_summary(cfg.run_uri)
    if summary is None:
        raise RuntimeError(f"training finished but wrote no summary.json under {cfg.run_uri}")
    return summary


def say_batch(cfg: Config, vocab: int, log: Callable[[str], None]) -> None:
    """The run's global batch, and how each usable size makes it up (an elastic run: a line per size)."""
    if not cfg.scaling.elastic:
        log(f"[raytrain] run {cfg.run.name} -> {cfg.run_uri} | global batch {cfg.global_batch} sequences = "
            f"{cfg.batch.micro_batch_size} micro x {cfg.accumulation} accumulation x {cfg.scaling.num_workers} workers")
        return
    from raytrain.elastic.size_table import lines
    from raytrain.sweep.memory_estimate import param_count

    log(f"[raytrain] run {cfg.run.name} -> {cfg.run_uri} | global batch {cfg.global_batch} sequences at every size "
        f"in scaling.num_workers={cfg.scaling.num_workers}")
    for line in lines(cfg, param_count(cfg, vocab), per_node=ranks_per_node(cfg)):
        log(line)


def ranks_per_node(cfg: Config) -> int:
    """The most workers one alive node of the connected cluster holds (1 where none holds any yet)."""
    import ray

    from raytrain.elastic.sizing import workers_on

    per_worker = cfg.scaling.worker_resources
    return max([workers_on(n.get("Resources") or {}, per_worker) for n in ray.nodes() if n.get("Alive")] + [1])


def audit_submit(cfg: Config, submitted: Optional[dict]) -> dict:
    """The run's "submit" audit record: config.yaml is rewritten at every submission, so each one's resolved config
    (and its sha256, the digest config.yaml has now) and the overrides given are kept in <run>/audit."""
    import getpass
    import hashlib
    import socket

    from raytrain.audit import run_event

    text = cfg.to_yaml()
    submitted = submitted or {}
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers): the record says so rather than failing the run
        user = None
    return run_event(cfg.run_uri, "submit", run=cfg.run.name, config_sha256=hashlib.sha256(text.encode()).hexdigest(),
                     recipe=submitted.get("recipe"), overrides=submitted.get("overrides"), config=cfg.to_dict(),
                     user=user, host=socket.gethostname())


# glibc's heap settings where the run is submitted reach the training workers, which otherwise inherit the environment
# of the `ray start` that started their node. By default a worker hands start-up's full-size blocks back to the OS
# (raytrain/worker/host_heap.py); a MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ set here replaces that.
# RAYTRAIN_INTERNALS=stock (raytrain/internals) holds for the workers too.
PROPAGATED_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "RAYTRAIN_INTERNALS")


def worker_env() -> dict:
    """Environment variables of the training worker processes (set by Ray before they start)."""
    return {k: os.environ[k] for k in PROPAGATED_ENV if k in os.environ}


def _fit(trainer, cfg: Config, *, submitted: float, log: Callable[[str], None]) -> None:
    """trainer.fit(), with the run's node records, its events (elastic.jsonl) and host-memory snapshots around it, the
    goodput ledger after it; our errors as one line."""
    from raytrain.ckpt.snapshot_actor import release_run as release_memory
    from raytrain.cost import NodeRecorder
    from raytrain.elastic.events import Relay
    from raytrain.restart_phases import forget as forget_restart_phases

    # Node time by market and lost nodes, for `raytrain cost` (raytrain/cost.py).
    recorder = NodeRecorder(cfg.run_uri) if cfg.cost.record_nodes else contextlib.nullcontext()
    comm_file = RunDir(cfg.run_uri).uri(COMM_FAILURE)
    storage.delete_file(comm_file)  # an earlier submission's diagnosis is not this one's
    # Host-memory snapshots live only while the run does: a killed driver's are removed here, the rest in finally.
    release_memory(cfg.run_uri, cfg.checkpoint.memory_dir)
    gauges = None
    if cfg.metrics.prometheus and cfg.metrics.goodput_every_s > 0:  # the ledger live, on Ray's Prometheus endpoint
        from raytrain.goodput_gauges import GoodputGauges

        gauges = GoodputGauges(cfg.run_uri, cfg.run.name, every_s=cfg.metrics.goodput_every_s)
    try:
        with recorder, Relay(cfg.run_uri, log, submitted=submitted):
            trainer.fit()
    except KeyboardInterrupt:
        raise KeyboardInterrupt("the run's committed checkpoints are kept: the same command resumes it") from None
    except Exception as e:  # noqa: BLE001 - Ray wraps worker errors; surface ours as one line
        waited = _capacity_timeout(e)
        if waited is not None:
            raise waited from None
        msg = failure_line(e, cfg.run_uri)
        # Ours in full (Ray truncates a worker's error text); or, on NCCL, the watchdog killed the worker
        # before Python could raise, and the diagnosis filed just before is all there is.
        if (msg is None or "CommunicationError: " in str(e)) and storage.exists(comm_file):
            msg = storage.read_text(comm_file).strip()  # whole: Ray truncates a worker's error text
        if msg:
            raise UserError(msg) from None
        raise
    finally:
        release_memory(cfg.run_uri, cfg.checkpoint.memory_dir)
        forget_restart_phases(cfg.run_uri)
        final = _goodput(cfg.run_uri, log)
        if gauges is not None:
            gauges.close(final)


def _goodput(run_uri: str, log: Callable[[str], None]) -> Optional[dict]:
    """The run's goodput ledger, kept in goodput.json and said in one line; returned."""
    from raytrain.goodput import ledger

    try:
        g = ledger(run_uri)
    except Exception as e:  # noqa: BLE001 - accounting must never be why a run fails
        log(f"[raytrain] warning: no goodput ledger ({type(e).__name__}: {e})")
        return None
    if g is None:
        return None
    RunDir(run_uri).write_json(GOODPUT, g)
    bad = sorted(((k, v) for k, v in g["seconds"].items() if k != "productive"), key=lambda kv: -kv[1])[:3]
    log(f"[raytrain] goodput {g['goodput']:.1%} of {g['wall_s']:.1f} s; most badput: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in bad) + " (raytrain report)")
    return g
