"""The per-worker training run inside each Ray Train worker: `WorkerRun(loop_config).run()`, read top to bottom.

`__init__` builds the components, each from its own config section plus keyword-only runtime values: the
data plane (this rank's rows by the sample plan, and the data position), the DeepSpeed engine, the
checkpoint writer and its cadence, the step's agreement, the evaluator, telemetry, the run log and the record
writer (every metric record's one path to its sinks).
`run()` is the loop; `step()`, `after_step()`, `roll_back()` and `finish()` are its parts.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain.config import Config
from raytrain.console import say
from raytrain.audit import run_event
from raytrain.rundir import RESTORES, RunDir
from raytrain.data.manifest import Split
from raytrain.ds_config import build_ds_config, resolve_dtype
from raytrain.errors import RestoreElsewhere, UserError
from raytrain.ckpt.layout import dir_name, step_of
from raytrain.ckpt.host_snapshots import MemoryTier, apply as apply_snapshot, check as check_snapshot, resizable
from raytrain.ckpt.restore import (agree_apply, find_memory_point, find_resume_point, peek_state, resize_memory_point,
                                   restore)
from raytrain.worker.rollback import roll_back
from raytrain.ckpt.state import TrainState
from raytrain.ckpt.writer import CheckpointWriter
from raytrain import lora, storage
from raytrain.faults import Faults
from raytrain.model import build_model, flops_per_token, moe_aux_loss, param_counts
from raytrain.quiet import no_stdout, quiet_worker
from raytrain.worker.comm import watch_for_run
from raytrain.worker.data_plane import DataPlane
from raytrain.worker.downstream import DownstreamEvals
from raytrain.worker.evaluate import evaluator_for
from raytrain.worker import host_heap
from raytrain.worker.loss import StepLoss
from raytrain.worker.interval import cadence_for, run_history
from raytrain.worker.engine import make_engine
from raytrain.worker.host_reads import StepProbe
from raytrain.worker.preemption import PreemptionNotice
from raytrain.worker.records import RecordWriter
from raytrain.worker.runlog import Attempt, RunLog, progress_every
from raytrain.worker.telemetry import Telemetry, Window, first_step_memory, oom_guard
from raytrain.worker.trackers import Trackers
from raytrain.worker.verdict import StepAgreement, StepVerdict


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train's entry point on every worker."""
    WorkerRun(loop_config).run()


class WorkerRun:
    """One attempt of one rank: the components, built once; the loop over steps."""

    def __init__(self, loop_config: dict):
        quiet_worker()  # before DeepSpeed's first import: it announces the accelerator it guessed
        import ray.train
        import ray.train.torch

        self.t_start = time.time()
        host_heap.start()  # start-up's full-size blocks go back to the OS when freed, until the first step is done
        ctx = ray.train.get_context()
        rank, world = self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        cfg = self.cfg = Config.model_validate(loop_config["config"]).at_size(world)  # an elastic run: this size's batch
        train_split = Split.from_dict(loop_config["train_split"])
        val_split = Split.from_dict(loop_config["val_split"]) if loop_config.get("val_split") else None
        self.cuda, self.device = _device(cfg, ray.train.torch)
        # Resume point first: host memory (this node's snapshot of the newest step every rank holds), else the newest
        # committed checkpoint in the run directory (our manifests); another world size's goes through universal form.
        self.faults = Faults(loop_config.get("inject"), rank=rank, global_batch=cfg.global_batch)
        self.memory = MemoryTier(cfg.checkpoint, run_uri=cfg.run_uri, rank=rank, world=world, drills=self.faults,
                                 enabled=cfg.deepspeed.tensor_parallel_size == 1)
        self.from_memory = find_memory_point(self.memory, rank, resizable=resizable(cfg.deepspeed))
        resumed = None if self.from_memory else find_resume_point(
            cfg.run_uri, rank, deep=cfg.checkpoint.verify_on_resume == "checksum", local_dir=cfg.checkpoint.local_dir,
            tensor_parallel=cfg.deepspeed.tensor_parallel_size > 1)
        self.boot = {"resume_point": time.time()}  # start-up phases (when each ended): where a recovery's seconds go
        # The data plane before the engine where each rank's slice is known now (no tensor parallelism): its first
        # reads (the ray reader's pipeline start) overlap the engine build. Rebuilt if the restore lands elsewhere.
        early = _counters(self.from_memory, resumed) if cfg.deepspeed.tensor_parallel_size == 1 else None
        self.data = self._data_plane(early, rank, world, loop_config, train_split) if early else None
        # Python's cyclic collector off while transformers and DeepSpeed are imported and the engine built: their
        # hundreds of thousands of new objects set off full collections that free nothing (0.3-0.6 s of a start).
        gc.disable()
        try:
            self.engine, self.n_params, n_active = self._build_engine(resumed, train_split, self.device)
        finally:
            gc.enable()
        dp_rank, self.dp_size = _data_parallel_rank(cfg, rank, world)
        self.boot["engine"] = time.time()
        if self.from_memory is not None:  # every rank can apply its snapshot, or all restore from storage
            resumed = self._vote_on_memory()
        # (run start, attempts before this one): from attempts.jsonl, or carried by the memory snapshot (no storage
        # request between a fault and the first resumed step: _open_records writes and reads after it).
        carried = (self.from_memory.state.get("run_records") or {}) if self.from_memory else {}
        started, earlier_attempts = (carried["run_started"], carried["attempts"] + 1) \
            if "attempts" in carried else run_history(cfg.run_uri)
        self.state = self._restore(resumed, earlier_attempts)
        if self.lora_base is not None:  # the adapter must meet the base it was trained on
            lora.check_base(self.state.lora_base, self.lora_base["sha256"], resumed.uri if resumed else cfg.run_uri)
            self.state.lora_base = self.lora_base
        self.boot["restore"] = time.time()
        self.resumed_from = dir_name(self.state.step) if resumed else None
        self.audit = self._resume_audit(resumed, earlier_attempts)
        self.data = self._data_plane((self.state.step, self.state.samples_seen), dp_rank, self.dp_size, loop_config,
                                     train_split)  # the early one if the restore landed where it was predicted
        self.loss = StepLoss(cfg.data, window=train_split.seq_len + 1, accumulation=cfg.accumulation, world=world,
                             dp_size=self.dp_size, device=self.device)  # masked and globally normalised for examples
        self.evaluate = evaluator_for(cfg.data, split=val_split, sources=loop_config.get("val_sources"),
                                      micro_batch=cfg.batch.micro_batch_size, rank=dp_rank, world=self.dp_size,
                                      device=self.device)
        self.log = RunLog(cfg.run_uri, cfg.run.max_steps, self.state.step, enabled=rank == 0,
                          tail=carried.get("log_tail", ()),
                          progress_every=progress_every(cfg.run.progress_every, cfg.run.log_every, cfg.run.max_steps))
        # Downstream (lm-eval) evaluations of committed checkpoints, on Ray tasks of their own (rank 0 hands over).
        self.downstream = DownstreamEvals(cfg.eval, run_uri=cfg.run_uri, enabled=rank == 0, log=say)
        self.writer = CheckpointWriter(cfg.checkpoint, run_uri=cfg.run_uri, rank=rank, world=world,
                                       protect=(f"{cfg.run_uri}/{self.resumed_from}",) if resumed else (),  # never pruned
                                       on_commit=self.memory.note_committed)  # the node actors learn of it at once
        self.cadence = cadence_for(cfg.checkpoint, run_started=started, restarts=earlier_attempts)
        # What this attempt's snapshots carry (the first attempt's start is its own, as attempts.jsonl will say).
        self.run_records = {"run_started": round(self.t_start, 3) if started is None else started, "attempts": earlier_attempts}
        self.notice = PreemptionNotice(rank, enabled=cfg.checkpoint.on_preemption, run_uri=cfg.run_uri,
                                       leave=loop_config.get("elastic", False), watch=cfg.checkpoint.watch_notices)
        self.agreement = StepAgreement(notice=self.notice, cadence=self.cadence, rank=rank, world=world,
                                       device=self.device, snapshots=self.memory.interval,
                                       copies=world // self.dp_size, accumulation=cfg.accumulation)
        self.tel = Telemetry(cfg, rank, world, self.cuda, flops_per_token(n_active, cfg.model), log=say)
        # Every metric record's one path: metrics.jsonl, trackers, TensorBoard, Prometheus, Ray Train / Tune reports.
        self.records = RecordWriter(cfg, rank=rank, log=self.log, prometheus=self.tel.metrics, report=ray.train.report,
                                    trackers=Trackers(cfg, enabled=rank == 0, restarts=self.state.restarts, log=say))
        self.comm = watch_for_run(cfg, rank=rank, world=world, cuda=self.cuda,  # names the collective a rank waits in
                                  count=lambda rule: self.tel.metrics.count("raytrain_health_violations_total", rule=rule))
        self.probe = StepProbe(self.faults.host_reads_path, rank)  # fault injection's probe: off by default

    def run(self) -> None:
        """Take this rank's rows of the next global batch, step, judge the loss, log / evaluate / checkpoint."""
        self.start()
        cfg, gb = self.cfg, self.cfg.global_batch
        while self.state.step < cfg.run.max_steps:
            nxt = self.state.step + 1
            self.probe.begin(nxt)  # fault injection's count of host reads (worker/host_reads.py); off by default
            self.tel.timer.step(sample=nxt % cfg.run.log_every == 0 or nxt == cfg.run.max_steps)
            with self.window.waiting():
                # This rank's lanes of the global batch at the run's data position: [acc * micro_batch, seq_len + 1]
                rows = self.data.take(self.state.samples_seen)
            self.attempt.got_batch()
            verdict, aux = self.step(rows)
            if self._judge(verdict):
                continue  # rolled back
            self.state.samples_seen += gb
            self.state.tokens_seen += gb * cfg.model.seq_len
            self.window.steps += 1
            if self.attempt.first:
                self._first_step_done()
            self.after_step(verdict, aux)
            self.probe.end(acts=any(self._due(self.state.step)))
        self.finish()

    def start(self) -> None:
        """The run's opening line (rank 0) and, on a fresh start, the step-0 validation (collective)."""
        if self.rank == 0:
            say(_banner(self.cfg, n_params=self.n_params, world=self.world, dp_size=self.dp_size, dtype=self.dtype,
                        resumed_step=self.state.step if self.resumed_from or self.from_memory else None,
                        cadence=self.cadence, kernels=self.kernels))
            if self.lora_base is not None:
                say(lora.describe(self.engine.module, self.cfg.model, self.n_params))
        if self.evaluate and self.state.step == 0:
            rec = {"step": 0, **self.evaluate.record(self.engine)}
            self.records.write(rec, "validation")
            self.log.console(rec)
            self.records.report()
        self.attempt = Attempt(self.cfg.run_uri, rank=self.rank, world=self.world, state=self.state,
                               t_start=self.t_start, boot=self.boot)  # recovery time, steps lost, cost
        self.window = Window(self.tel.timer)

    def step(self, rows: np.ndarray) -> tuple[StepVerdict, Optional[torch.Tensor]]:
        """Forward/backward and the optimizer step on this rank's rows; then the step's one all-reduce, whose
        verdict every rank acts on alike: read now on a step that acts on it, else at the next step (no host
        synchronisation: worker/verdict.py). Returns (verdict, this rank's MoE aux loss summed over its
        micro-batches, None without MoE)."""
        self.comm.step = self.state.step + 1
        with oom_guard(self.cfg, self.world, self.cuda), \
                self.comm("forward/backward and the optimizer step (gradient all-reduce)"):
            loss_sum, aux_sum = self._forward_backward(rows)
        self.state.step += 1
        self.attempt.reached(self.state.step)
        self.faults.after_step(self.state.step, say)
        with self.comm("the per-step all-reduce (loss, preemption notice, checkpoint agreement)"):
            now = any(self._due(self.state.step))  # a step that acts reads its verdict now, and logs its checksum
            verdict = self.agreement.agree(loss_sum, self.state.step, now=now,
                                           content=self.data.content_share() if now else 0)
        news = self.memory.interval.news()  # (agreed on the all-reduce, which may be read a step late)
        if news and self.rank == 0:
            say(f"memory snapshots {news}")
        return verdict, aux_sum

    def _due(self, step: int) -> tuple[bool, bool, bool]:
        """(log, evaluate, checkpoint by the step count) at this step: the steps that read their verdict now."""
        cfg = self.cfg
        last = step == cfg.run.max_steps
        do_log = step % cfg.run.log_every == 0 or last
        do_eval = self.evaluate is not None and ((cfg.run.eval_every and step % cfg.run.eval_every == 0) or last)
        counted = (last and cfg.checkpoint.save_final) or (not self.cadence.agreed and self.cadence.due(step))
        return do_log, bool(do_eval), counted

    def _judge(self, verdict: StepVerdict) -> bool:
        """The health rules on the losses read at this step, oldest first; True if the run rolled back."""
        for step, loss in verdict.losses:
            bad = self.tel.health.check_step(step, loss)
            if bad is None or bad.action == "warn":
                self.memory.judged(step)  # a snapshot of this step's weights may now be restored
                continue
            self.agreement.drop()  # this step is discarded with the rest
            self.notice.defer(verdict.preempted)  # acted on once the rolled-back steps are redone
            # the bad step's batch: this step's (not counted yet) or the one before it (a loss read late, when
            # this step's batch, read too, is skipped with it)
            gb = self.cfg.global_batch
            self.roll_back(bad, step=step, start=self.state.samples_seen - (self.state.step - step) * gb,
                           taken=self.state.samples_seen + gb)
            return True
        return False

    def after_step(self, verdict: StepVerdict, aux: Optional[torch.Tensor]) -> None:
        """Log, evaluate, checkpoint when due (every rank decides alike: the collectives inside never hang)."""
        cfg, step = self.cfg, self.state.step
        self._log_downstream(self.downstream.poll(self.writer.committed))
        if verdict.preempted and not self.notice.grow_heard:
            self.state.preemptions += 1  # survived once its checkpoint commits; the checkpoint carries the count
        do_log, do_eval, counted = self._due(step)
        do_ckpt = verdict.checkpoint_now or counted or verdict.preempted is not None
        rec: dict = {"step": step}
        if do_log or do_eval or do_ckpt:
            if do_log:
                rec.update(self._log_record(verdict, aux))
                rec.update(self.memory.record())  # the stall of the newest snapshot before this step's
            if do_eval:
                rec.update(self.evaluate.record(self.engine))
            self.tel.health.check_log(rec)
            self.records.write(rec, "validation" if do_eval else "step", sync=True if (do_eval or do_ckpt) else None)
        # After the step's record (a restore from this snapshot resumes past it: the snapshot carries the records
        # storage does not have yet), before any storage save of this step (memory is never older than a
        # committed checkpoint).
        if do_ckpt or not self.faults.snapshots_paused(step):
            self.memory.snapshot(self.engine, self.state, force=do_ckpt,
                                 run_records={**self.run_records, "log_tail": self.log.unsynced()},
                                 committed=step_of(self.writer.committed) if self.writer.committed else None)
        if not (do_log or do_eval or do_ckpt):
            return
        if do_ckpt:
            self._checkpoint(verdict.preempted)
        self.log.console(rec)  # after the save: the line names the checkpoint this step wrote
        if verdict.preempted:
            self._leave_for_preemption()
        self.records.report()  # the step's validation and checkpoint records, if any: one report (collective)

    def _first_step_done(self) -> None:
        """After the attempt's first step: the records start-up deferred are opened, then the attempt is recorded
        with its first step's end and the records' (the goodput ledger counts the deferred work in the first step's
        phase). Unless the step is logged, the log window restarts here: a first step's warm-up is not the run's
        throughput, and every later window's step time then covers exactly its own steps."""
        done = time.time()  # the first step's end: no storage request before it
        host_heap.steady(zero_stage=self.cfg.deepspeed.zero_stage, dp_size=self.dp_size)
        memory = None
        if self.rank == 0:  # measured against planned, once an attempt (a resize's micro-batch is another)
            memory = first_step_memory(self.cfg, n_params=self.n_params, cuda=self.cuda,
                                       vocab=self.engine.module.config.vocab_size)
            say(memory.pop("line"))
        self._open_records()
        if not self._due(self.state.step)[0]:
            self.window.reset()
        self.attempt.stepped(done, memory=memory)

    def _open_records(self) -> None:
        """After the attempt's first step: what start-up would otherwise read and write in storage between a fault
        and the first resumed step - the metrics history (then the downstream evaluations' catch-up and the
        checkpoint cost history read from it), the memory restore's restores.jsonl line, an earlier attempt's
        communication-failure diagnosis removed (rank 0; the others have nothing to do)."""
        if self.rank != 0:
            return
        if self.audit is not None:
            run_event(self.cfg.run_uri, "resume", **self.audit)
            if self.audit["from_world_size"] != self.audit["world_size"]:
                run_event(self.cfg.run_uri, "resize", step=self.audit["step"],
                          from_world_size=self.audit["from_world_size"], to_world_size=self.audit["world_size"])
            self.audit = None
        self.records.open()
        self.downstream.open(logged=self.log.history)
        self.cadence.seed([r["ckpt_stall_s"] for r in self.log.history if isinstance(r.get("ckpt_stall_s"), (int, float))])
        if self.from_memory is not None and self.from_memory.record is not None:
            RunDir(self.cfg.run_uri).append_jsonl(RESTORES, self.from_memory.record)

        self.comm.retract()  # an earlier attempt's diagnosis must not explain this one's end

    def roll_back(self, bad, *, step: int, start: int, taken: int) -> None:
        """A bad loss at `step`, whose batch began at sample `start`: back to the newest checkpoint, past the bad
        batch and every batch read (to sample `taken`) (collective)."""
        self.writer.wait()  # the newest checkpoint must be committed before it can be rolled back to
        self.memory.invalidate(everywhere=True)  # the snapshots since that checkpoint belong to the bad timeline
        self.state = roll_back(bad, tel=self.tel, engine=self.engine, state=self.state, bad_step=step,
                               bad_start=start, taken=taken, run_uri=self.cfg.run_uri,
                               global_batch=self.cfg.global_batch)
        # The steps since the checkpoint are trained again, from the new position on: the reader reads further.
        self.data.run_until(self.state.samples_seen, self.cfg.run.max_steps - self.state.step)
        self.log.rewind(self.state.step)
        self.records.write({"step": self.state.step, "event": "rollback", **self.tel.rolled_back[-1]}, "rollback",
                           sync=True)
        self.window.reset()
        self.tel.timer.take(1)

    def finish(self) -> None:
        """The final upload and commit, the data counters (collective) and summary.json (rank 0)."""
        self.memory.settle()  # the last snapshot's copy, committed (and offered to a peer) before the attempt ends
        if self.attempt.first:  # resumed at the last step: no step, so the records were not opened yet
            self._open_records()
        data_stats = self.data.stats(self.world, self.window.since_start(), self.state.samples_seen)
        self.data.close()
        self.writer.wait()
        self._log_downstream(self.downstream.poll(self.writer.committed, final=True)
                             + self.downstream.drain(self.cfg.eval.wait_at_end_s))
        self.attempt.close()
        self.notice.close()
        tracked = self.records.close()  # TensorBoard's last copy; the trackers' last records sent
        if self.rank == 0:
            self.log.write_summary(self.cfg, self.state, checkpoint=self.writer.committed or self.resumed_from,
                                   params=self.n_params,
                                   extra={**self.tel.summary(), **data_stats, **self.downstream.summary(), **tracked,
                                          "kernels": self.kernels,
                                          **({"trainable_params": lora.trainable_count(self.engine.module)}
                                             if self.lora_base is not None else {})})
        self.tel.close()
        self.comm.close()

    # --- the parts -----------------------------------------------------------------------------------

    def _build_engine(self, resumed, train_split: Split, device) -> tuple[object, int, int]:
        """The model, built for this config (ZeRO-3 partitioned as it is created, ZeRO-0/1/2 in the training
        dtype), and its DeepSpeed engine, which reuses the process group Ray Train set up."""
        cfg, cuda = self.cfg, self.cuda
        self.ckpt_world = peek_state(resumed).world_size if resumed is not None else self.world
        resharding = self.ckpt_world != self.world
        vocab = cfg.model.vocab_size or train_split.vocab_size
        # Native bf16 only: torch also says yes for pre-Ampere GPUs that emulate it (slowly); those get fp16.
        self.dtype = resolve_dtype(cfg, cuda, cuda and torch.cuda.is_bf16_supported(including_emulation=False))
        ds_config = build_ds_config(cfg, self.world, self.dtype, cuda)
        if resharding:
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        # A restore overwrites every weight (not a LoRA base, which no checkpoint holds): no random init to throw away.
        overwritten = (resumed is not None or self.from_memory is not None) and not lora.enabled(cfg.model)
        with no_stdout():
            model = build_model(cfg.model, vocab, cfg.run.seed, train_split.eot_id, ds_config=ds_config,
                                init=not overwritten)
        n_params, n_active = param_counts(model, cfg.model)  # active per token (MoE: top-k experts): the FLOPs behind MFU
        model, self.lora_base = lora.prepare_model(model, cfg.model, seed=cfg.run.seed)  # peft when model.lora.r > 0
        self.boot["model"] = time.time()
        engine, self.kernels = make_engine(model, cfg, ds_config=ds_config, cuda=cuda)
        return engine, n_params, n_active

    def _data_plane(self, counters: tuple[int, int], rank: int, size: int, loop_config: dict,
                    split: Split) -> DataPlane:
        """This rank's rows of each global batch from counters (step, samples_seen) on, by the sample plan, read
        ahead in the background (the one built before the engine, if it starts there)."""
        cfg, built = self.cfg, getattr(self, "data", None)
        if built is not None and self._data_from == counters:
            return built
        if built is not None:
            built.close()
        self._data_from = counters
        return DataPlane(cfg.data, split=split, seed=cfg.run.seed, global_batch=cfg.global_batch, rank=rank,
                         size=size, position=counters[1], steps_left=cfg.run.max_steps - counters[0],
                         device=self.device, mixture=loop_config.get("mixture"))

    def _vote_on_memory(self):
        """Before any collective of the restore: every rank says whether it holds its snapshot (fetched and read
        intact: find_memory_point) and can apply it (one small all-gather). If any cannot, every rank restores from
        storage instead (the resume point it returns), one warning says why, and restores.jsonl records it;
        snapshots of this timeline are not offered again."""
        cfg, rank = self.cfg, self.rank
        if self.from_memory.from_world is not None:  # another size's snapshots: this rank's state cut from them
            self.from_memory = resize_memory_point(self.memory, self.engine, self.from_memory, rank=rank)
        mine = self.from_memory.refused or check_snapshot(self.engine, self.from_memory.state, self.faults)
        refused = agree_apply(mine, rank, self.world)
        if refused is None:
            return None
        step = self.from_memory.step
        self.from_memory = None
        self.memory.invalidate(everywhere=True)
        if rank == 0:  # the restore goes to storage anyway: written now, before the storage restore's own line
            RunDir(cfg.run_uri).append_jsonl(RESTORES, {"source": "memory", "step": step, "ok": False,
                                                        "reason": refused, "time": round(time.time(), 3)})
        resumed = find_resume_point(cfg.run_uri, rank, deep=cfg.checkpoint.verify_on_resume == "checksum",
                                    local_dir=cfg.checkpoint.local_dir,
                                    tensor_parallel=cfg.deepspeed.tensor_parallel_size > 1)
        point = peek_state(resumed) if resumed is not None else None  # its counters: a few bytes, read once
        where = f"checkpoint {dir_name(point.step)}" if point is not None else "nothing"
        if rank == 0:
            say(f"warning: memory snapshot of step {step} not applied ({refused}); every rank restores from {where} "
                "in storage")
        if point is None or point.world_size != self.world:
            # The engine was built to be overwritten (no random init) at this world size: a new attempt builds
            # the right one, and these snapshots are gone, so it starts from storage.
            raise RestoreElsewhere(f"memory snapshot of step {step} not applied ({refused}); restarting to restore "
                               f"from {where} in storage")
        return resumed

    def _resume_audit(self, resumed, earlier_attempts: int) -> Optional[dict]:
        """The attempt's resume audit record (raytrain/audit.py), written with the attempt's other records after its
        first step: nothing touches storage between a fault and the first resumed step. None on a fresh start."""
        if resumed is None and self.from_memory is None:
            return None
        return {"step": self.state.step, "samples_seen": self.state.samples_seen, "checkpoint": self.resumed_from,
                "source": "memory" if self.from_memory is not None else "storage", "attempt": earlier_attempts,
                "world_size": self.world,
                "from_world_size": self.ckpt_world if self.from_memory is None else
                self.from_memory.from_world or self.world}

    def _restore(self, resumed, earlier_attempts: int) -> TrainState:
        """Engine, RNG and counters from the resume point (collective), or a fresh state."""
        state = TrainState(world_size=self.world, global_batch=self.cfg.global_batch)
        if self.from_memory is not None:
            state = apply_snapshot(self.engine, self.from_memory.state)
            self.from_memory.state = None  # the copy is in the engine now
            state.restarts += 1
            state.world_size, state.global_batch = self.world, self.cfg.global_batch
        elif resumed is not None:
            state = restore(self.engine, resumed, rank=self.rank, world=self.world)
            state.restarts += 1
            state.global_batch = self.cfg.global_batch
        elif self.rank == 0:
            # Nothing committed yet: whether the workers' credentials may write the run, before the first step rather
            # than at the first checkpoint (the driver probed with its own; a worker role is often narrower).
            storage.check_writable(self.cfg.run_uri)
        # A restart from scratch (an attempt that died before its first checkpoint committed) is a restart
        # too, though no checkpoint carries its count.
        state.restarts = max(state.restarts, earlier_attempts)
        state.dtype = self.dtype
        self.memory.interval.begin(state.step, restarts=state.restarts)  # `auto`: measured, then agreed
        return state

    def _forward_backward(self, rows: np.ndarray) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Over this rank's micro-batches, and the optimizer step; (loss sum, MoE aux loss sum or None), fp32."""
        cfg, engine, timer = self.cfg, self.engine, self.tel.timer
        mb, acc = cfg.batch.micro_batch_size, cfg.accumulation
        # Each micro-batch's loss and MoE router load-balancing loss (logged as aux_loss), summed once at the end:
        # every tensor op on the host costs tens of microseconds between a step's kernels.
        losses, auxes = [], []
        self.loss.begin(rows)  # fine-tuning rows: the global batch's learned-token count (collective)
        for a in range(acc):
            x = _to_device(rows[a * mb:(a + 1) * mb], self.device, cfg.data.pin_memory)
            with timer("forward_backward"):
                loss = self.faults.loss(self.state.samples_seen, self.loss(engine, x))
                aux = moe_aux_loss(engine.module)
                engine.backward(loss if aux is None else loss + cfg.model.moe_aux_loss_coef * aux)
            with timer("optimizer"):
                if a == acc - 1:
                    self.memory.settle()  # the last snapshot's copy from the GPU has landed before its sources change
                engine.step()  # DeepSpeed only updates at the accumulation boundary
            losses.append(loss.detach())
            if aux is not None:
                auxes.append(aux.detach())
        return _total(losses), _total(auxes)

    def _log_record(self, verdict: StepVerdict, aux: Optional[torch.Tensor]) -> dict:
        """A log step's figures; starts the next window (collective: the MoE aux loss and the data counters are
        all-reduced)."""
        cfg, engine, win, world = self.cfg, self.engine, self.window, self.world
        gb, seq = cfg.global_batch, cfg.model.seq_len
        window_steps, dt, data_wait = win.steps, win.elapsed(), win.data_wait
        rec: dict = {"loss": verdict.loss}
        if aux is not None:  # MoE: the router's load-balancing loss, per micro-batch
            rec["aux_loss"] = _mean_across_ranks(aux / cfg.accumulation, world)
        tps = window_steps * gb * seq / dt
        grad_norm = engine.get_global_grad_norm()
        rec.update({
            "lr": engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tps, "samples_per_s": window_steps * gb / dt,
            "tflops_per_worker": self.tel.fpt * tps / world / 1e12, "data_wait_frac": data_wait / dt,
            "tokens_seen": self.state.tokens_seen, "epoch": self.data.epoch(self.state.samples_seen),
            # Which samples this step trained on, from the plan (resumed runs are checked against it), and the
            # checksum of the rows it trained on, as read (data/content_checksum.py).
            "batch_crc32": self.data.fingerprint(), "content_checksum": verdict.content,
            # Where this step's batch starts in the sample stream: `raytrain data trace` anchors on it.
            "data_position": self.state.samples_seen - gb,
            **self.data.stats(world, win.since_start(), self.state.samples_seen),
        })
        if self.dtype == "fp16":
            # Loss-scale overflows: DeepSpeed skips the update (and the lr schedule's step) on its own.
            rec["fp16_skipped_steps"] = engine.skipped_steps
        rec.update(self.tel.log_step({"step": self.state.step, **rec}, self.state, window_steps, dt))
        win.reset()
        return rec

    def _log_downstream(self, recs: list[dict]) -> None:
        """Finished downstream evaluations, at their checkpoints' steps (rank 0): the sinks with history, Prometheus."""
        for rec in recs:
            self.tel.health.check_log(rec)
            self.records.write(rec, "downstream", sync=True)
            say(f"downstream evaluation of step {rec['step']}: " + ", ".join(
                f"{k[5:]} {v:.4f}" for k, v in rec.items() if k.startswith("eval/") and "_stderr" not in k))

    def _checkpoint(self, preempted: Optional[str]) -> None:
        """Save (collective) and record what it cost; the progress line names it."""
        if preempted and self.rank == 0:
            say(f"preemption notice at step {self.state.step}: {preempted}; checkpointing now")
        name = self.writer.save(self.engine, self.state, self.cfg.to_yaml())
        stall = self.writer.last_stall_s
        self.tel.checkpoint_saved(stall)
        self.cadence.saved(stall)
        self.records.write({"step": self.state.step, "checkpoint": name, "ckpt_stall_s": stall,
                            "ckpt_mode": self.cfg.checkpoint.upload, "preemption_checkpoint": preempted is not None,
                            **({"grow_checkpoint": True} if preempted and self.notice.grow_heard else {}),
                            **self.cadence.record()}, "checkpoint")
        self.log.checkpoint = name

    def _leave_for_preemption(self) -> None:
        """The notice's checkpoint is committed before any rank leaves; then SIGTERM'd ranks exit, and a drained
        node's ranks wait for the node to go."""
        self.writer.wait()
        if self.world > 1:
            dist.barrier()
        self.memory.note_committed(self.state.step)  # no restore takes an older snapshot (another size's) over it
        self.notice.committed(self.state.step)  # (a grow's request: the controller restarts the group from it)
        self.notice.exit_if_terminated()
        self.notice.hold()


def _to_device(rows: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    """A micro-batch of token ids (int32 from the reader) as an int64 tensor on the device. CUDA with pin:
    through pinned memory and a non-blocking copy of the int32 ids (half the bytes), widened on the GPU."""
    x = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type != "cuda":
        return x.long()
    return (x.pin_memory() if pin else x).to(device, non_blocking=pin).long()


def _total(parts: list) -> Optional[torch.Tensor]:
    """The fp32 sum of a step's per-micro-batch values (None for none)."""
    if not parts:
        return None
    total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(dtype=torch.float32)
    return total if total.dtype == torch.float32 else total.float()


def _counters(from_memory, resumed) -> Optional[tuple[int, int]]:
    """(step, samples_seen) the attempt will resume at, read before the engine is built: the memory snapshot's, the
    checkpoint's (a few bytes), or a fresh start's."""
    if from_memory is not None and from_memory.counters is not None:
        return from_memory.counters  # another size's snapshots, read once the engine is built
    if from_memory is not None and from_memory.state is None:
        return None  # this rank could not read it: the vote sends every rank to storage, not predicted here
    if from_memory is not None:
        st = TrainState.from_dict(from_memory.state["train_state"])
    elif resumed is not None:
        st = peek_state(resumed)
    else:
        return 0, 0
    return st.step, st.samples_seen


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


def _banner(cfg: Config, *, n_params: int, world: int, dp_size: int, dtype: str, resumed_step, cadence,
            kernels: dict) -> str:
    mb, acc, gb, seq = cfg.batch.micro_batch_size, cfg.accumulation, cfg.global_batch, cfg.model.seq_len
    workers = f"{world} workers" if dp_size == world else f"{dp_size} data-parallel x {world // dp_size} tensor-parallel workers"
    return (f"{cfg.model.family} {n_params/1e6:.2f}M params | {workers} x micro_batch {mb} x "
            f"accumulation {acc} = global batch {gb} sequences ({gb*seq} tokens) | ZeRO-{cfg.deepspeed.zero_stage} "
            f"{dtype} | compiled: {kernels['compiled']}, loss: {kernels['loss']}, {kernels['optimizer']} | "
            f"{'resuming from step ' + str(resumed_step) if resumed_step is not None else 'fresh start'} | "
            f"checkpoints {cadence.describe()}")
