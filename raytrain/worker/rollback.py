"""The health rules' rollback action: back to the newest complete checkpoint, past the bad data window."""

from __future__ import annotations

import dataclasses

from raytrain.audit import run_event
from raytrain.ckpt.restore import find_resume_point, restore
from raytrain.ckpt.state import TrainState
from raytrain.console import say
from raytrain.worker.telemetry import stop


def roll_back(violation, *, tel, engine, state: TrainState, bad_step: int, bad_start: int, taken: int, run_uri: str,
              global_batch: int) -> TrainState:
    """The action for a NaN/inf or spiking loss (collective: every rank calls it at the same step).

    Restores the engine (weights, optimizer, schedule) and RNG from the newest complete checkpoint and
    keeps the data position *after* the offending batch (step `bad_step`, from sample `bad_start`; plus
    health.skip_batches - 1 more batches; at least past `taken`, the end of the newest batch read, which a loss
    judged a step late puts one batch further): the steps
    since the checkpoint are trained again, on the data that follows the bad window, so the window from
    the checkpoint's position to past the bad batch is never trained on. Returns the new
    TrainState. Stops the run with a report when rollbacks exceed health.max_rollbacks or there is no
    checkpoint to go back to.
    """
    v, h = violation, tel.cfg.health
    if v.action == "stop" or tel.rollbacks >= h.max_rollbacks:
        why = ("health.on_bad_loss=stop" if v.action == "stop" else
               f"{tel.rollbacks} rollbacks already (health.max_rollbacks={h.max_rollbacks})")
        stop(tel, run_uri, f"{v.message}; {why}")
    resumed = find_resume_point(run_uri, tel.rank, local_dir=tel.cfg.checkpoint.local_dir,
                                tensor_parallel=tel.cfg.deepspeed.tensor_parallel_size > 1)
    if resumed is None:
        stop(tel, run_uri, f"{v.message} before the first complete checkpoint, nothing to roll back to; "
                           f"lower optim.lr or checkpoint earlier (checkpoint.every_n_steps)")
    restored = restore(engine, resumed, rank=tel.rank, world=tel.world)
    # Counters other than the position keep counting (restarts, preemptions, ...): only the training progress goes
    # back to the checkpoint; the data position moves on past the bad batch and health.skip_batches - 1 more.
    new = dataclasses.replace(state, step=restored.step, tokens_seen=restored.tokens_seen,
                              samples_seen=max(bad_start + h.skip_batches * global_batch, taken))
    tel.rollbacks += 1
    # Skipped: everything from the checkpoint's position on, up to and past the bad batch (as PaLM did
    # for loss spikes): the updates made from that window are gone with the rollback.
    tel.rolled_back.append({"bad_step": bad_step, "resumed_from": restored.step, "rule": v.rule,
                            "bad_batch": [bad_start, bad_start + global_batch],
                            "skipped": [restored.samples_seen, new.samples_seen]})
    tel.health.restarted()
    if tel.rank == 0:
        run_event(run_uri, "rollback", source="health", rule=v.rule, message=v.message, bad_step=bad_step,
                  resumed_from=restored.step, bad_batch=[bad_start, bad_start + global_batch],
                  skipped=[restored.samples_seen, new.samples_seen], rollbacks=tel.rollbacks)
        say(f"rollback {tel.rollbacks}/{h.max_rollbacks}: {v.message}; back to step {restored.step}, skipping "
            f"samples {restored.samples_seen}..{new.samples_seen - 1} of the data stream (bad batch from {bad_start})")
    return new
