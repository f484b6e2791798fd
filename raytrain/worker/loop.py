"""The per-worker training loop (runs inside each Ray Train worker). Readable top to bottom.

Everything that is not "take a batch, step the engine" is a component it calls: the data plane
(this rank's rows by the sample plan, and the data position), the checkpoint path, the evaluator and the run log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain import storage
from raytrain.config import Config
from raytrain.data.manifest import Split
from raytrain.quiet import no_stdout, quiet_worker
from raytrain.ds_config import build_ds_config, lr_lambda, resolve_dtype
from raytrain.errors import UserError
from raytrain.model import build_model, param_groups, compile_engine, flops_per_token, moe_aux_loss, param_counts
from raytrain.ckpt.layout import dir_name
from raytrain.ckpt.restore import find_resume_point, peek_state, restore
from raytrain.ckpt.rollback import roll_back
from raytrain.ckpt.state import TrainState
from raytrain.ckpt.writer import CheckpointWriter
from raytrain.worker.comm import FAILURE_FILE as COMM_FAILURE_FILE, CommWatch
from raytrain.worker.data_plane import DataPlane
from raytrain.worker.evaluate import Evaluator, lm_loss
from raytrain.worker.interval import CheckpointInterval, run_history
from raytrain.worker.preemption import PreemptionNotice
from raytrain.worker.runlog import SUMMARY, Heartbeat, RunLog, progress_every, record_attempt, say
from raytrain.worker.telemetry import Telemetry, nan_hook, oom_guard


def _to_device(rows: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    """A micro-batch of token ids (int32 from the reader) as an int64 tensor on the device. CUDA with pin:
    through pinned memory and a non-blocking copy of the int32 ids (half the bytes), widened on the GPU."""
    x = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type != "cuda":
        return x.long()
    return (x.pin_memory() if pin else x).to(device, non_blocking=pin).long()


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
    quiet_worker()  # before DeepSpeed's first import: it announces the accelerator it guessed
    import deepspeed
    import ray.train
    import ray.train.torch

    t_start = time.time()
    cfg = Config.model_validate(loop_config["config"])
    train_split = Split.from_dict(loop_config["train_split"])
    val_split = Split.from_dict(loop_config["val_split"]) if loop_config.get("val_split") else None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cuda, device = _device(cfg, ray.train.torch)

    # Resume point first: the newest committed checkpoint in the run directory, whether this is a worker
    # restart inside one job or the same run submitted again. (Ray's own registry can miss the newest
    # one when a worker dies right after uploading; our manifests cannot.) A checkpoint written by
    # another number of workers is loaded through DeepSpeed's universal format.
    resumed = find_resume_point(cfg.run_uri, rank, deep=cfg.checkpoint.verify_on_resume == "checksum",
                                local_dir=cfg.checkpoint.local_dir,
                                tensor_parallel=cfg.deepspeed.tensor_parallel_size > 1)
    resharding = resumed is not None and peek_state(resumed).world_size != world
    boot = {"resume_point": time.time()}  # start-up phases (when each ended): where a recovery's seconds go

    # Model and engine. DeepSpeed reuses the process group Ray Train already set up.
    vocab = cfg.model.vocab_size or train_split.vocab_size
    # Native bf16 only: torch also says yes for pre-Ampere GPUs that emulate it (slowly); those get fp16.
    dtype = resolve_dtype(cfg, cuda, cuda and torch.cuda.is_bf16_supported(including_emulation=False))
    ds_config = build_ds_config(cfg, world, dtype, cuda)
    if resharding:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    # Built for this config: ZeRO-3 partitioned as it is created, ZeRO-0/1/2 in the training dtype.
    with no_stdout():
        model = build_model(cfg.model, vocab, cfg.run.seed, train_split.eot_id, ds_config=ds_config)
    n_params, n_active = param_counts(model, cfg.model)  # active per token (MoE: top-k experts): the FLOPs behind MFU
    boot["model"] = time.time()
    with no_stdout():
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.optim.weight_decay),
            config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
            dist_init_required=False,
        )
    compile_engine(engine, cfg.model)
    dp_rank, dp_size = _data_parallel_rank(cfg, rank, world)
    boot["engine"] = time.time()
    state = TrainState(world_size=world, global_batch=cfg.global_batch)
    if resumed is not None:
        state = restore(engine, resumed, rank=rank, world=world)
        state.restarts += 1
        state.global_batch = cfg.global_batch
    # The run's earlier attempts: a restart from scratch (an attempt that died before its first checkpoint
    # committed) is a restart too, though no checkpoint carries its count.
    history = run_history(cfg.run_uri)
    state.restarts = max(state.restarts, history[1])
    boot["restore"] = time.time()
    # This rank's rows of each global batch, by the sample plan, read ahead in the background.
    data = DataPlane(train_split, cfg.run.seed, cfg.data.shuffle, cfg.global_batch, dp_rank, dp_size, state.samples_seen,
                     cfg.run.max_steps - state.step, cfg.data.stall_timeout_s, cfg.data.on_bad_shard, device)

    evaluate = Evaluator(val_split, cfg.data.eval_samples, cfg.batch.micro_batch_size, dp_rank, dp_size, device,
                         cfg.data.on_bad_shard) if val_split else None
    log = RunLog(cfg.run_uri, cfg.run.max_steps, state.step, enabled=rank == 0,
                 progress_every=progress_every(cfg.run.progress_every, cfg.run.log_every, cfg.run.max_steps))
    # The checkpoint this attempt resumed from is never pruned while it runs.
    writer = CheckpointWriter(cfg.checkpoint, run_uri=cfg.run_uri, rank=rank, world=world,
                              protect=(f"{cfg.run_uri}/{dir_name(state.step)}",) if resumed else ())
    interval = CheckpointInterval(cfg.checkpoint.every_n_steps, cfg.checkpoint.mtbf_s, cfg.checkpoint.auto_initial_cost_s,
                                  *history)
    interval.seed([r["ckpt_stall_s"] for r in log.history if isinstance(r.get("ckpt_stall_s"), (int, float))])
    notice = PreemptionNotice(rank, world, cfg.checkpoint.on_preemption, carry_checkpoint=interval.auto, device=device)
    acc, gb = cfg.accumulation, cfg.global_batch
    tel = Telemetry(cfg, rank, world, cuda, flops_per_token(n_active, cfg.model), log=say)  # metrics, timers, health
    comm = _comm_watch(cfg, rank, world, cuda, tel)  # names the collective a rank waits in
    parts = _Parts(cfg, rank, world, engine, data, tel, log, writer, interval, notice, evaluate, dtype)
    _start(parts, state, n_params, dp_size, resumed is not None)

    last_ckpt = dir_name(state.step) if resumed else None
    crash_at = _crash_hook(loop_config.get("inject") or {}, rank)
    poison = nan_hook(loop_config.get("inject") or {}, rank, gb)
    first = _Attempt(cfg.run_uri, rank, world, state, t_start, boot)  # recovery time, steps lost, cost
    win = _Window()
    while state.step < cfg.run.max_steps:
        nxt = state.step + 1
        tel.timer.step(sample=nxt % cfg.run.log_every == 0 or nxt == cfg.run.max_steps)
        with win.waiting(tel):
            rows = data.take()  # this rank's lanes of the global batch: [acc * micro_batch, seq_len + 1]
        first.got_batch()
        comm.step = state.step + 1
        with oom_guard(cfg, world, cuda), comm("forward/backward and the optimizer step (gradient all-reduce)"):
            loss_sum, aux_sum = _train_step(engine, rows, cfg, device, tel, poison, state.samples_seen)
        state.step += 1
        first.beat.beat(state.step)
        crash_at(state.step)
        # Every step, one all-reduce: the loss (all ranks judge the same loss, so all take the same action),
        # with the preemption flags and rank 0's "checkpoint now" (auto interval) riding along.
        with comm("the per-step all-reduce (loss, preemption notice, checkpoint agreement)"):
            step_loss = notice.agree(loss_sum / acc, world,
                                     want_checkpoint=interval.auto and rank == 0 and interval.due(state.step))
        bad = tel.health.check_step(state.step, step_loss)
        if bad is not None and bad.action != "warn":
            state = _roll_back(parts, bad, state, win)
            continue
        preempted = notice.take()
        first.stepped()
        state.samples_seen += gb
        state.tokens_seen += gb * cfg.model.seq_len
        win.steps += 1

        _after_step(parts, state, step_loss, aux_sum / acc, win, preempted)

    data_stats = data.stats(world, win.since_start())  # collective: every rank
    data.close()
    writer.wait()  # the final upload and commit
    first.beat.close()
    if rank == 0:
        _write_summary(cfg, log, state, writer.committed or last_ckpt, n_params, extra={**tel.summary(), **data_stats})
    tel.close()
    comm.close()


@dataclasses.dataclass
class _Parts:
    """The components a step's reporting and checkpointing use."""

    cfg: Config
    rank: int
    world: int
    engine: object
    data: DataPlane
    tel: Telemetry
    log: RunLog
    writer: CheckpointWriter
    interval: CheckpointInterval
    notice: PreemptionNotice
    evaluate: Optional[Evaluator]
    dtype: str


def _start(p: _Parts, state, n_params: int, dp_size: int, resumed: bool) -> None:
    """The run's opening line (rank 0) and, on a fresh start, the step-0 validation (collective)."""
    if p.rank == 0:
        say(_banner(p.cfg, n_params, p.world, dp_size, p.dtype, state.step if resumed else None, p.interval))
    if p.evaluate and state.step == 0:
        val_loss, val_ppl = p.evaluate(p.engine)
        p.log.write({"step": 0, "val_loss": val_loss, "val_ppl": val_ppl})
        p.log.console({"step": 0, "val_loss": val_loss, "val_ppl": val_ppl})


def _roll_back(p: _Parts, bad, state, win: "_Window"):
    """A bad loss: back to the newest checkpoint, past the bad batch (collective); returns the new state."""
    p.writer.wait()  # the newest checkpoint must be committed before it can be rolled back to
    state = roll_back(bad, tel=p.tel, engine=p.engine, state=state, data=p.data, run_uri=p.cfg.run_uri,
                      global_batch=p.cfg.global_batch)
    p.data.run_until(p.cfg.run.max_steps - state.step)  # the steps since the checkpoint are trained again
    p.log.rewind(state.step)
    p.log.write({"step": state.step, "event": "rollback", **p.tel.rolled_back[-1]}, sync=True)
    win.reset()
    p.tel.timer.take(1)
    return state


def _after_step(p: _Parts, state, step_loss: float, aux: torch.Tensor, win: "_Window", preempted: Optional[str]) -> None:
    """Log, evaluate, checkpoint when due (every rank decides alike: the collectives inside never hang)."""
    cfg, last = p.cfg, state.step == p.cfg.run.max_steps
    do_log = state.step % cfg.run.log_every == 0 or last
    do_eval = p.evaluate is not None and ((cfg.run.eval_every and state.step % cfg.run.eval_every == 0) or last)
    scheduled = p.notice.checkpoint_agreed if p.interval.auto else p.interval.due(state.step)
    do_ckpt = scheduled or (last and cfg.checkpoint.save_final) or preempted is not None
    if not (do_log or do_eval or do_ckpt):
        return
    rec: dict = {"step": state.step}
    if do_log:
        rec.update(_log_record(cfg, p.engine, state, p.data, p.tel, p.world, step_loss, aux, win, p.dtype))
    if do_eval:
        rec["val_loss"], rec["val_ppl"] = p.evaluate(p.engine)
    p.tel.observe(rec, sync=do_eval or do_ckpt)
    p.log.write(rec, sync=True if (do_eval or do_ckpt) else None)
    if do_ckpt:
        _checkpoint(cfg, p.engine, state, p.writer, p.tel, p.interval, p.log, p.rank, preempted)
    p.log.console(rec)  # after the save: the line names the checkpoint this step wrote
    if preempted:
        # The notice's checkpoint must be committed before any rank leaves.
        p.writer.wait()
        if p.world > 1:
            dist.barrier()
        p.notice.exit_if_terminated()
        p.notice.hold()
    if do_eval:
        import ray.train

        # Metrics-only reports are kept to eval steps: each report waits for Ray Train's controller
        # to collect it (about a second), which would throttle a loop that logs every step.
        ray.train.report(rec)


class _Window:
    """Time, steps and data wait since the last log line (throughput is measured per window)."""

    def __init__(self):
        self.t_start = time.perf_counter()
        self.reset()

    def reset(self) -> None:
        self.t, self.steps, self.data_wait = time.perf_counter(), 0, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t

    def since_start(self) -> float:
        return time.perf_counter() - self.t_start

    @contextlib.contextmanager
    def waiting(self, tel: Telemetry):
        t0 = time.perf_counter()
        yield
        waited = time.perf_counter() - t0
        self.data_wait += waited
        tel.timer.add("data_wait", waited)


class _Attempt:
    """Where this attempt started and when its first step was done (rank 0 records it): recovery time, steps
    lost, cost. Owns the heartbeat that tells a later attempt how far this one got."""

    def __init__(self, run_uri: str, rank: int, world: int, state, t_start: float, boot: dict):
        self.run_uri, self.t_start, self.boot = run_uri, t_start, boot
        self.beat = Heartbeat(run_uri, enabled=rank == 0).start(state.restarts, state.step)
        self.rec = {"attempt": state.restarts, "resumed_step": state.step, "time": round(t_start, 3),
                    "world_size": world, **({"previous_progress": self.beat.previous} if self.beat.previous else {})} \
            if rank == 0 else None
        boot["setup"] = time.time()

    def got_batch(self) -> None:
        if self.rec is not None:
            self.boot["first_batch"] = time.time()

    def stepped(self) -> None:
        if self.rec is not None:
            record_attempt(self.run_uri, {**self.rec, "first_step_time": round(time.time(), 3),
                                          "startup_s": {k: round(v - self.t_start, 3) for k, v in self.boot.items()}})
            self.rec = None


def _device(cfg: Config, train_torch) -> tuple[bool, torch.device]:
    """(cuda, this worker's device); also the torch threads and seeds every rank shares."""
    cuda = cfg.scaling.use_gpu and torch.cuda.is_available()
    if cfg.scaling.use_gpu and not cuda:
        # The process group is NCCL already; a CPU fallback would fail later with a cryptic NCCL error.
        raise UserError(f"scaling.use_gpu=true but this worker's torch {torch.__version__} sees no CUDA device "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): install a CUDA "
                        "build of torch on the GPU nodes, or set scaling.use_gpu=false")
    device = train_torch.get_device() if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    # Same seed on every rank: identical initial weights; data differs by lane, not by RNG.
    torch.manual_seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    return cuda, device


def _comm_watch(cfg: Config, rank: int, world: int, cuda: bool, tel: Telemetry) -> CommWatch:
    """Names the collective a rank waits in; a timeout becomes a diagnosis (in the run directory), not a hang."""
    comm_file = storage.join(cfg.run_uri, COMM_FAILURE_FILE)
    if rank == 0:
        storage.delete_file(comm_file)  # an earlier attempt's diagnosis must not explain this one's end
    return CommWatch(rank, world, "nccl" if cuda else "gloo", cfg.scaling.collective_timeout_s,
                     count=lambda rule: tel.metrics.count("raytrain_health_violations_total", rule=rule),
                     report=lambda msg: storage.write_text(comm_file, msg),
                     retract=lambda: storage.delete_file(comm_file))


def _banner(cfg: Config, n_params: int, world: int, dp_size: int, dtype: str, resumed_step, interval) -> str:
    mb, acc, gb, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.global_batch, cfg.model.seq_len
    workers = f"{world} workers" if dp_size == world else f"{dp_size} data-parallel x {world // dp_size} tensor-parallel workers"
    return (f"{cfg.model.family} {n_params/1e6:.2f}M params | {workers} x micro_batch {mb} x "
            f"accumulation {acc} = global batch {gb} sequences ({gb*seq} tokens) | ZeRO-{cfg.deepspeed.zero_stage} "
            f"{dtype} | {'resuming from step ' + str(resumed_step) if resumed_step is not None else 'fresh start'} | "
            f"checkpoints {interval.describe()}")


def _train_step(engine, rows: np.ndarray, cfg: Config, device, tel: Telemetry, poison,
                samples_seen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over this rank's micro-batches and the optimizer step; (loss sum, MoE aux loss sum)."""
    mb, acc = cfg.batch.micro_batch_size, cfg.accumulation
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)  # MoE router load-balancing loss, logged as aux_loss
    for a in range(acc):
        x = _to_device(rows[a * mb:(a + 1) * mb], device, cfg.data.pin_memory)
        with tel.timer("forward_backward"):
            loss = poison(samples_seen, lm_loss(engine, x))
            aux = moe_aux_loss(engine.module)
            engine.backward(loss if aux is None else loss + cfg.model.moe_aux_loss_coef * aux)
        with tel.timer("optimizer"):
            engine.step()  # DeepSpeed only updates at the accumulation boundary
        loss_sum += loss.detach().float()
        aux_sum += aux.detach().float() if aux is not None else 0.0
    return loss_sum, aux_sum


def _log_record(cfg: Config, engine, state, data: DataPlane, tel: Telemetry, world: int, step_loss: float,
                aux: torch.Tensor, win: _Window, dtype: str) -> dict:
    """A log step's figures; starts the next window (collective: the MoE aux loss and the data counters are
    all-reduced)."""
    gb, seq, fpt = cfg.global_batch, cfg.model.seq_len, tel.fpt
    window_steps, dt, data_wait = win.steps, win.elapsed(), win.data_wait
    rec: dict = {"loss": step_loss}
    if cfg.model.family == "mixtral":
        rec["aux_loss"] = _mean_across_ranks(aux, world)
    tps = window_steps * gb * seq / dt
    grad_norm = engine.get_global_grad_norm()
    rec.update({
        "lr": engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_s": tps, "samples_per_s": window_steps * gb / dt,
        "tflops_per_worker": fpt * tps / world / 1e12, "data_wait_frac": data_wait / dt,
        "tokens_seen": state.tokens_seen, "epoch": data.epoch,
        # Which samples this step trained on, from the plan (resumed runs are checked against it).
        "batch_crc32": data.fingerprint(),
        **data.stats(world, win.since_start()),
    })
    if dtype == "fp16":
        # Loss-scale overflows: DeepSpeed skips the update (and the lr schedule's step) on its own.
        rec["fp16_skipped_steps"] = engine.skipped_steps
    rec.update(tel.log_step({"step": state.step, **rec}, state, window_steps, dt))
    win.reset()
    return rec


def _checkpoint(cfg: Config, engine, state, writer, tel: Telemetry, interval, log: RunLog, rank: int, preempted) -> None:
    """Save (collective) and record what it cost; the progress line names it."""
    if preempted and rank == 0:
        say(f"preemption notice at step {state.step}: {preempted}; checkpointing now")
    name = writer.save(engine, state, cfg.to_yaml())
    tel.checkpoint_saved(writer.last_stall_s)
    interval.saved(writer.last_stall_s)
    log.write({"step": state.step, "checkpoint": name, "ckpt_stall_s": writer.last_stall_s,
               "ckpt_mode": cfg.checkpoint.upload, "preemption_checkpoint": preempted is not None,
               **({"auto_interval_s": round(interval.interval_s, 2)} if interval.auto else {})})
    log.checkpoint = name


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


def _write_summary(cfg: Config, log: RunLog, state: TrainState, last_ckpt, n_params: int,
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
    # The driver prints it (format_summary); the console does not get it twice.
    storage.write_text(storage.join(cfg.run_uri, SUMMARY), json.dumps(summary, indent=1))
