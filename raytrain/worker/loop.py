"""The per-worker training loop (runs inside each Ray Train worker). Readable top to bottom.

Everything that is not "take a batch, step the engine" is a component it calls: the sample stream
(data position), the checkpoint path, the evaluator and the run log.
"""

from __future__ import annotations

import logging
import os
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from raytrain import storage
from raytrain.config import Config
from raytrain.data.manifest import Split
from raytrain.data.stream import SampleStream
from raytrain.ds_config import build_ds_config, lr_lambda, resolve_dtype
from raytrain.errors import UserError
from raytrain.model import build_model, compile_engine, flops_per_token, moe_aux_loss, param_counts
from raytrain.worker import checkpoint as ckpt
from raytrain.worker.comm import FAILURE_FILE as COMM_FAILURE_FILE, CommWatch
from raytrain.worker.evaluate import Evaluator, lm_loss
from raytrain.worker.interval import CheckpointInterval, run_history
from raytrain.worker.preemption import PreemptionNotice
from raytrain.worker.runlog import SUMMARY, Heartbeat, RunLog, record_attempt, say
from raytrain.worker.telemetry import Telemetry, nan_hook, oom_guard, rollback


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # No decay on biases, norms and embeddings' 1-D params: the usual GPT recipe.
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)  # ds_shape: ZeRO-3
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _to_device(rows: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    """A micro-batch as a tensor on the device. CPU: the stream's own memory, no copy. CUDA with pin: through
    pinned memory and a non-blocking copy, so the transfer overlaps kernels already queued."""
    x = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type != "cuda":
        return x
    return (x.pin_memory() if pin else x).to(device, non_blocking=pin)


def _data_parallel_rank(cfg: Config, rank: int, world: int) -> tuple[int, int]:
    """(rank, size) among the workers that train on different data. The ranks of one tensor-parallel group
    (DeepSpeed AutoTP) compute one model together, so they take the same slice of the global batch."""
    if cfg.deepspeed.tensor_parallel_size == 1:
        return rank, world
    from deepspeed.utils import groups  # set up by deepspeed.initialize

    return groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()


def _mean_across_ranks(x: torch.Tensor, world: int) -> float:
    if world > 1:
        dist.all_reduce(x)
        x = x / world
    return x.item()


def train_loop_per_worker(loop_config: dict) -> None:
    import deepspeed
    import ray.train
    import ray.train.torch

    # Per-report INFO lines from Ray Train / Ray Data drown the progress lines; warnings still show.
    for name in ("ray.train", "ray.train.v2", "ray.train.v2._internal.execution.context", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    t_start = time.time()
    cfg = Config.model_validate(loop_config["config"])
    train_split = Split.from_dict(loop_config["train_split"])
    val_split = Split.from_dict(loop_config["val_split"]) if loop_config.get("val_split") else None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cuda = cfg.scaling.use_gpu and torch.cuda.is_available()
    if cfg.scaling.use_gpu and not cuda:
        # The process group is NCCL already; a CPU fallback would fail later with a cryptic NCCL error.
        raise UserError(f"scaling.use_gpu=true but this worker's torch {torch.__version__} sees no CUDA device "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): install a CUDA "
                        "build of torch on the GPU nodes, or set scaling.use_gpu=false")
    device = ray.train.torch.get_device() if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    # Same seed on every rank: identical initial weights; data differs by slice, not by RNG.
    torch.manual_seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)

    # Resume point first: the newest committed checkpoint in the run directory, whether this is a worker
    # restart inside one job or the same run submitted again. (Ray's own registry can miss the newest
    # one when a worker dies right after uploading; our manifests cannot.) A checkpoint written by
    # another number of workers is loaded through DeepSpeed's universal format.
    resumed = ckpt.find_resume_point(cfg.run_uri, rank, deep=cfg.checkpoint.verify_on_resume == "checksum",
                                     local_dir=cfg.checkpoint.local_dir,
                                     tensor_parallel=cfg.deepspeed.tensor_parallel_size > 1)
    resharding = resumed is not None and ckpt.peek_state(resumed).world_size != world
    boot = {"resume_point": time.time()}  # start-up phases (when each ended): where a recovery's seconds go

    # Model and engine. DeepSpeed reuses the process group Ray Train already set up.
    vocab = cfg.model.vocab_size or train_split.vocab_size
    # Native bf16 only: torch also says yes for pre-Ampere GPUs that emulate it (slowly); those get fp16.
    dtype = resolve_dtype(cfg, cuda, cuda and torch.cuda.is_bf16_supported(including_emulation=False))
    ds_config = build_ds_config(cfg, world, dtype, cuda)
    if resharding:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    # Built for this config: ZeRO-3 partitioned as it is created, ZeRO-0/1/2 in the training dtype.
    model = build_model(cfg.model, vocab, cfg.run.seed, train_split.eot_id, ds_config=ds_config)
    n_params, n_active = param_counts(model, cfg.model)  # active per token (MoE: top-k experts): the FLOPs behind MFU
    boot["model"] = time.time()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=_param_groups(model, cfg.optim.weight_decay),
        config=ds_config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
        dist_init_required=False,
    )
    compile_engine(engine, cfg.model)
    dp_rank, dp_size = _data_parallel_rank(cfg, rank, world)
    boot["engine"] = time.time()
    state = ckpt.TrainState(world_size=world, global_batch=cfg.global_batch)
    if resumed is not None:
        state = ckpt.restore(engine, resumed, rank, world)
        state.restarts += 1
        state.global_batch = cfg.global_batch
    # The run's earlier attempts: a restart from scratch (an attempt that died before its first checkpoint
    # committed) is a restart too, though no checkpoint carries its count.
    history = run_history(cfg.run_uri)
    state.restarts = max(state.restarts, history[1])
    boot["restore"] = time.time()
    # Started only now: on small machines, Ray Data's start-up competing with DeepSpeed's
    # initialisation slowed both down more than running them one after the other.
    stream = SampleStream(train_split, cfg.run.seed, cfg.data.shuffle, cfg.data.shuffle_window, state.samples_seen,
                          reader=loop_config.get("reader", "ray"), prefetch=cfg.data.prefetch_batches,
                          read_cpus=cfg.scaling.data_cpus / max(1, world), background=True,
                          stall_timeout_s=cfg.data.stall_timeout_s, on_bad_shard=cfg.data.on_bad_shard).start()

    # Validation is small and read once, so a direct read beats starting a Ray Data pipeline for it.
    evaluate = Evaluator(val_split, cfg.data.eval_samples, cfg.batch.micro_batch_size, dp_rank, dp_size, device,
                         "pyarrow") if val_split else None
    log = RunLog(cfg.run_uri, cfg.run.max_steps, state.step, enabled=rank == 0)
    # The checkpoint this attempt resumed from is never pruned while it runs.
    writer = ckpt.CheckpointWriter(cfg.checkpoint, cfg.run_uri, rank, world,
                                   protect=(f"{cfg.run_uri}/{ckpt.dir_name(state.step)}",) if resumed else ())
    interval = CheckpointInterval(cfg.checkpoint.every_n_steps, cfg.checkpoint.mtbf_s, cfg.checkpoint.auto_initial_cost_s,
                                  *history)
    interval.seed([r["ckpt_stall_s"] for r in log.history if isinstance(r.get("ckpt_stall_s"), (int, float))])
    notice = PreemptionNotice(rank, world, cfg.checkpoint.preemption_check_s, cfg.checkpoint.on_preemption,
                              carry_checkpoint=interval.auto, device=device)
    config_yaml = cfg.to_yaml()
    mb, acc, gb, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.global_batch, cfg.model.seq_len
    fpt = flops_per_token(n_active, cfg.model)
    tel = Telemetry(cfg, rank, world, cuda, fpt, log=say)  # metrics export, phase timers, health rules
    # Names the collective a rank waits in; a timeout becomes a diagnosis, not a hang.
    comm_file = storage.join(cfg.run_uri, COMM_FAILURE_FILE)
    if rank == 0:
        storage.delete_file(comm_file)  # an earlier attempt's diagnosis must not explain this one's end
    comm = CommWatch(rank, world, "nccl" if cuda else "gloo", cfg.scaling.collective_timeout_s,
                     count=lambda rule: tel.metrics.count("raytrain_health_violations_total", rule=rule),
                     report=lambda msg: storage.write_text(comm_file, msg),
                     retract=lambda: storage.delete_file(comm_file))
    if rank == 0:
        workers = f"{world} workers" if dp_size == world else f"{dp_size} data-parallel x {world // dp_size} tensor-parallel workers"
        say(f"{cfg.model.family} {n_params/1e6:.2f}M params | {workers} x micro_batch {mb} x "
              f"accumulation {acc} = global batch {gb} sequences ({gb*seq} tokens) | ZeRO-{cfg.deepspeed.zero_stage} "
              f"{dtype} | {'resuming from step ' + str(state.step) if resumed else 'fresh start'} | "
              f"checkpoints {interval.describe()}")

    if evaluate and state.step == 0:
        val_loss, val_ppl = evaluate(engine)
        log.write({"step": 0, "val_loss": val_loss, "val_ppl": val_ppl})
        log.console({"step": 0, "val_loss": val_loss, "val_ppl": val_ppl})

    last_ckpt = ckpt.dir_name(state.step) if resumed else None
    crash_at = _crash_hook(loop_config.get("inject") or {}, rank)
    # Where this attempt started and when its first step was done: recovery time, steps lost, cost.
    beat = Heartbeat(cfg.run_uri, enabled=rank == 0).start(state.restarts, state.step)
    attempt = {"attempt": state.restarts, "resumed_step": state.step, "time": round(t_start, 3),
               "world_size": world, **({"previous_progress": beat.previous} if beat.previous else {})} \
        if rank == 0 else None
    poison = nan_hook(loop_config.get("inject") or {}, rank, gb)
    window_t, window_steps, data_wait = time.perf_counter(), 0, 0.0
    boot["setup"] = time.time()
    while state.step < cfg.run.max_steps:
        t0 = time.perf_counter()
        nxt = state.step + 1
        tel.timer.step(sample=nxt % cfg.run.log_every == 0 or nxt == cfg.run.max_steps)
        batch = stream.take(gb)  # the whole global batch; this rank trains on its slice of it
        if attempt is not None:
            boot["first_batch"] = time.time()
        # A fingerprint of exactly which samples this step trained on: resumed runs are checked against it.
        batch_crc = zlib.crc32(np.ascontiguousarray(batch).tobytes())
        data_wait += (waited := time.perf_counter() - t0)
        tel.timer.add("data_wait", waited)
        loss_sum = torch.zeros((), device=device)
        aux_sum = torch.zeros((), device=device)  # MoE router load-balancing loss, logged as aux_loss
        comm.step = state.step + 1
        with oom_guard(cfg, world, cuda), comm("forward/backward and the optimizer step (gradient all-reduce)"):
            for a in range(acc):
                rows = batch[(a * dp_size + dp_rank) * mb:(a * dp_size + dp_rank + 1) * mb]
                x = _to_device(rows, device, cfg.data.pin_memory)
                with tel.timer("forward_backward"):
                    loss = poison(state.samples_seen, lm_loss(engine, x))
                    aux = moe_aux_loss(engine.module)
                    engine.backward(loss if aux is None else loss + cfg.model.moe_aux_loss_coef * aux)
                with tel.timer("optimizer"):
                    engine.step()  # DeepSpeed only updates at the accumulation boundary
                loss_sum += loss.detach().float()
                aux_sum += aux.detach().float() if aux is not None else 0.0
        state.step += 1
        beat.beat(state.step)
        crash_at(state.step)
        # Every step, one scalar all-reduce: all ranks judge the same loss, so all take the same action.
        with comm("the all-reduce of the step loss"):
            step_loss = _mean_across_ranks(loss_sum / acc, world)
        bad = tel.health.check_step(state.step, step_loss)
        if bad is not None and bad.action != "warn":
            writer.wait()  # the newest checkpoint must be committed before it can be rolled back to
            state = rollback(bad, tel, engine, state, stream, cfg.run_uri, gb)
            log.rewind(state.step)
            log.write({"step": state.step, "event": "rollback", **tel.rolled_back[-1]}, sync=True)
            window_t, window_steps, data_wait = time.perf_counter(), 0, 0.0
            tel.timer.take(1)
            continue
        # Collective, every step: all ranks agree on when to save (a notice, or rank 0's auto interval).
        with comm("the per-step agreement all-reduce (preemption notice, checkpoint)"):
            preempted = notice.poll(state.step, want_checkpoint=interval.auto and rank == 0 and interval.due(state.step))
        if attempt is not None:
            record_attempt(cfg.run_uri, {**attempt, "first_step_time": round(time.time(), 3),
                                         "startup_s": {k: round(v - t_start, 3) for k, v in boot.items()}})
            attempt = None
        state.samples_seen += gb
        state.tokens_seen += gb * seq
        window_steps += 1

        last = state.step == cfg.run.max_steps
        do_log = state.step % cfg.run.log_every == 0 or last
        do_eval = evaluate is not None and ((cfg.run.eval_every and state.step % cfg.run.eval_every == 0) or last)
        scheduled = notice.checkpoint_agreed if interval.auto else interval.due(state.step)
        do_ckpt = scheduled or (last and cfg.checkpoint.save_final) or preempted is not None
        if not (do_log or do_eval or do_ckpt):
            continue

        rec: dict = {"step": state.step}
        if do_log:
            # Collective: every rank computes the same do_log, so this all-reduce never hangs.
            rec["loss"] = step_loss
            if cfg.model.family == "mixtral":
                rec["aux_loss"] = _mean_across_ranks(aux_sum / acc, world)
            dt = time.perf_counter() - window_t
            tps = window_steps * gb * seq / dt
            grad_norm = engine.get_global_grad_norm()
            rec.update({
                "lr": engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": tps, "samples_per_s": window_steps * gb / dt,
                "tflops_per_worker": fpt * tps / world / 1e12, "data_wait_frac": data_wait / dt,
                "tokens_seen": state.tokens_seen, "epoch": stream.epoch, "batch_crc32": batch_crc, "data_skipped_shards": len(stream.skipped),
            })
            if dtype == "fp16":
                # Loss-scale overflows: DeepSpeed skips the update (and the lr schedule's step) on its own.
                rec["fp16_skipped_steps"] = engine.skipped_steps
            rec.update(tel.log_step(rec, state, window_steps, dt))
            window_t, window_steps, data_wait = time.perf_counter(), 0, 0.0
        if do_eval:
            rec["val_loss"], rec["val_ppl"] = evaluate(engine)
        tel.observe(rec, sync=do_eval or do_ckpt)
        log.write(rec, sync=True if (do_eval or do_ckpt) else None)
        log.console(rec)
        if do_ckpt:
            if preempted and rank == 0:
                say(f"preemption notice at step {state.step}: {preempted}; checkpointing now")
            name = writer.save(engine, state, config_yaml)
            tel.checkpoint_saved(writer.last_stall_s)
            interval.saved(writer.last_stall_s)
            log.write({"step": state.step, "checkpoint": name, "ckpt_stall_s": writer.last_stall_s,
                       "ckpt_mode": cfg.checkpoint.upload, "preemption_checkpoint": preempted is not None,
                       **({"auto_interval_s": round(interval.interval_s, 2)} if interval.auto else {})})
            if rank == 0:
                say(f"checkpoint {name}: training paused {writer.last_stall_s:.2f}s ({cfg.checkpoint.upload} upload)")
            if preempted:
                # The notice's checkpoint must be committed before any rank leaves.
                writer.wait()
                if world > 1:
                    dist.barrier()
                notice.exit_if_terminated()
                notice.hold()
        if do_eval:
            # Metrics-only reports are kept to eval steps: each report waits for Ray Train's controller
            # to collect it (about a second), which would throttle a loop that logs every step.
            ray.train.report(rec)

    writer.wait()  # the final upload and commit
    beat.close()
    last_ckpt = writer.committed or last_ckpt
    if rank == 0:
        _write_summary(cfg, log, state, last_ckpt, n_params, extra=tel.summary())
    tel.close()
    comm.close()


def _crash_hook(inject: dict, rank: int):
    """Fault injection for tests and chaos drills: signal this worker process at given steps.

    `inject = {"crash_at_step": N, "rank": r, "signal": "SIGKILL", "marker": path}` for one event, or
    `{"events": [{"step": N, "rank": r, "signal": ...}, ...], "marker": dir}` for several ("STALL" with
    "seconds": the rank hangs instead). A marker
    file per event makes each fire once, so the restarted worker trains on past that step. SIGTERM
    goes through the worker's real handler (a preemption checkpoint); SIGKILL dies on the spot.
    """
    import signal

    events = inject.get("events") or ([{"step": inject["crash_at_step"], "rank": inject.get("rank", 0),
                                        "signal": inject.get("signal", "SIGKILL")}] if inject.get("crash_at_step") else [])
    marker = inject.get("marker")
    mine = [(i, e) for i, e in enumerate(events) if e.get("rank", 0) == rank]
    if not mine or not marker:
        return lambda step: None

    def hook(step: int) -> None:
        for i, e in mine:
            fired = f"{marker}.{i}" if inject.get("events") else marker
            if step == e["step"] and not os.path.exists(fired):
                with open(fired, "w") as f:
                    f.write(str(time.time()))  # when it fired: recovery time is measured from here
                sig = e.get("signal", "SIGKILL")
                say(f"injected {sig} at step {step} (rank {rank})")
                if sig in ("REMOVE_NODE", "DRAIN_NODE"):
                    # Node-level events are carried out by the chaos harness (scripts/chaos.py) on
                    # this worker's node; a removed node takes this process with it.
                    import json

                    import ray

                    with open(fired + ".request", "w") as f:
                        json.dump({"action": sig, "node_id": ray.get_runtime_context().get_node_id()}, f)
                    if sig == "REMOVE_NODE":
                        time.sleep(300)
                    else:
                        # Ray relays a drain to the workers within its poll interval (5 s): this step
                        # lasts long enough for the notice to arrive during the run, as on a real cluster.
                        for _ in range(600):
                            if os.path.exists(fired + ".ack"):
                                break
                            time.sleep(0.1)
                        time.sleep(8)
                elif sig == "STALL":
                    time.sleep(e.get("seconds", 60))  # a hung rank: its peers wait in the next collective
                else:
                    os.kill(os.getpid(), getattr(signal, sig))

    return hook


def _write_summary(cfg: Config, log: RunLog, state: ckpt.TrainState, last_ckpt, n_params: int,
                   extra: dict | None = None) -> None:
    import json

    tps = [r["tokens_per_s"] for r in log.history if "tokens_per_s" in r]
    steady = tps[1:] or tps  # the first window includes warm-up (allocation, first data read)
    summary = {
        "run": cfg.run.name,
        "run_uri": cfg.run_uri,
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        "final_loss": log.last("loss"),
        "val_loss": log.last("val_loss"),
        "val_ppl": log.last("val_ppl"),
        "initial_val_ppl": log.first("val_ppl"),
        "tokens_per_s": sum(steady) / len(steady) if steady else None,
        "params": n_params,
        "wall_s": round(time.time() - log.t_start, 2),
        "restarts": state.restarts,
        "checkpoint": storage.join(cfg.run_uri, last_ckpt) if last_ckpt else None,
        "mfu": log.last("mfu"),
        **(extra or {}),  # health: rollbacks, violations per rule
    }
    log.sync()
    storage.write_text(storage.join(cfg.run_uri, SUMMARY), json.dumps(summary, indent=1))
    say("summary " + json.dumps(summary))
