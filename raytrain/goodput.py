"""The goodput ledger: every second of a run's wall time, from submission to its end, attributed to exactly one kind.

Read after the fact from the run directory: the driver's and controller's events (elastic.jsonl: submitted,
started, waiting, capacity_back, grow, lost_node, reclaimed, ended), each attempt's start-up phases and the controller's restart
phases (attempts.jsonl), and the steps of the run's final timeline (metrics.jsonl, whose lines past a resumed step
were dropped on resume). Kinds, after Google's ml-goodput-measurement:

- `productive`: steps that count (the optimizer's work on batches that stayed in the run's timeline);
- `redone`: steps trained past the step the next attempt resumed from, thrown away;
- `data_wait`, `checkpoint_stall`, `evaluation`: inside an attempt's training, time the loop waited for its rows,
  stood still for a checkpoint (an async upload beside training is not badput: only the stall counts), validated;
- `start/...`, `restart/...`, `resize/...`: from submission (or a fault, or a decision to grow) to the next first
  step, by phase: `driver` (checks before Ray Train starts), `detect` (from the last step and its records - log line,
  evaluation, checkpoint - to the controller seeing the fault), `notice` (instead of `detect` after a preemption
  notice's checkpoint, itself a checkpoint stall: the ranks hold until the node goes), `teardown`, `schedule` (placing
  the new group), `workers` (Ray's worker processes), `restore` (finding, fetching and converting the checkpoint or
  snapshot, loading it), `setup` (imports, model, engine), `first_step` (up to its log record, the storage reads and
  writes start-up defers past it included);
- `waiting`: below an elastic run's MIN, waiting for nodes;
- `finish`: after a submission's last step (the final checkpoint's upload, shutdown);
- `start/unfinished`: a submission none of whose groups reached a first step (besides its waits);
- `not_running`: between the end of one submission of the run and the next;
- `other`: what none of the above covers (the loop's own work between steps, clock gaps).
Precedence where activities overlap: waiting, then the restart phases, then evaluation, checkpoint stall, data wait,
redone and productive steps. Seconds are wall seconds of the run, not node-seconds.
"""

from __future__ import annotations

from typing import Any, Optional

from raytrain.rundir import ATTEMPTS, ELASTIC, METRICS, RunDir

STEP_KINDS = ("productive", "redone", "data_wait", "checkpoint_stall", "evaluation")
GAP_PHASES = ("detect", "teardown", "schedule", "workers", "setup", "restore", "first_step")


def ledger(run_uri: str, *, reader=None) -> Optional[dict[str, Any]]:
    """The run's ledger ({"wall_s", "seconds": {kind: s}, "attempts": [...], "sizes": [(time, workers)], ...}); None
    for a run with no submission event (trained before the ledger existed). `reader`: what reads the run's JSONL
    files (default: RunDir, whole; the live gauges' reads only what each file gained)."""
    rd = reader or RunDir(run_uri)
    events = rd.read_jsonl(ELASTIC)
    attempts = rd.read_jsonl(ATTEMPTS)
    steps = [r for r in rd.read_jsonl(METRICS) if "loss" in r or "val_loss" in r or "checkpoint" in r]
    submitted = next((e["time"] for e in events if e.get("event") == "submitted"), None)
    if submitted is None:
        return None
    ended = [e["time"] for e in events if e.get("event") == "ended"]
    # The last `ended`, unless a later submission is still running (`raytrain report` on it): its newest record.
    t_end = max([submitted] + ended[-1:] + [r["time"] for r in steps] + [a.get("first_step_time", 0) for a in attempts])
    sec: dict[str, float] = {}
    per_attempt = []
    waits = _waits(events, t_end)
    submissions = sorted(e["time"] for e in events if e.get("event") == "submitted")
    prev_end, prev_first = submitted, submitted
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        first_end = _first_end(a, nxt, steps)
        sub = max((t for t in submissions if t <= a["time"]), default=submitted)
        fresh = i == 0 or sub > prev_end  # this attempt opens a submission (the run was not running before it)
        if fresh and sub > prev_end:  # the previous submission's end, and any that never trained, then none running
            _idle(sec, events, (prev_end, sub), waits, kind="finish" if i else "start/unfinished")
        starting = (a.get("controller") or {}).get("group_starting") or a["time"]
        kind = "start" if fresh else _why(events, prev_first, starting)
        # (a grow's checkpoint is taken like a notice's, but what follows it is the resize's teardown, not a notice)
        noticed = any(r.get("preemption_checkpoint") and not r.get("grow_checkpoint")
                      and prev_end - 5 <= r["time"] <= prev_end + 5 for r in steps)
        gap = _gap(a, sub if fresh else prev_end, first_end, first=fresh, noticed=noticed)
        gap_s = _add_gap(sec, kind, gap, waits)
        beat = _own_beat(a, nxt)
        end = _attempt_end(a, nxt, t_end, [r for r in steps if r["time"] >= first_end - 1e-3], beat)
        mine = [r for r in steps if first_end - 1e-3 <= r["time"] <= end + 1e-3]
        kept_to = None if nxt is None else int(nxt.get("resumed_step") or 0)  # the next attempt redid what followed
        kinds = _training(mine, first_end, end, resumed=int(a.get("resumed_step") or 0),
                          last=int(beat["step"]) if beat else None, kept_to=kept_to)
        for k, v in kinds.items():
            sec[k] = sec.get(k, 0.0) + v
        per_attempt.append({"attempt": a.get("attempt", i), "world_size": a.get("world_size"),
                            "resumed_step": a.get("resumed_step"), "start": round(sub if fresh else prev_end, 3),
                            "first_step": round(first_end, 3), "end": round(end, 3), "kind": kind,
                            "gap_s": round(gap_s, 3),
                            "steps": _steps_after_first(mine, first_end, int(a.get("resumed_step") or 0),
                                                        min(kept_to, int(beat["step"])) if beat else None),
                            **{k: round(v, 3) for k, v in kinds.items()}})
        prev_end, prev_first = end, first_end
    # After the last step: its submission's end (or, with no attempt, a start that never got there), later ones.
    _idle(sec, events, (prev_end, t_end), waits, kind="finish" if attempts else "start/unfinished")
    wall = t_end - submitted
    sec["other"] = max(0.0, wall - sum(sec.values()))
    good = sec.get("productive", 0.0)
    return {"wall_s": round(wall, 3), "submitted": submitted, "ended": t_end,
            "seconds": {k: round(v, 3) for k, v in sorted(sec.items(), key=lambda kv: -kv[1])},
            "goodput": round(good / wall, 4) if wall > 0 else None, "attempts": per_attempt,
            "sizes": [(p["first_step"], p["world_size"]) for p in per_attempt]}


def _first_end(a: dict, nxt: Optional[dict], steps: list[dict]) -> float:
    """When an attempt's first step phase ended: once the records start-up deferred past that step were opened, or,
    where the step was logged, at its log record (the attempt's own record written first)."""
    t = float(a.get("records_opened_time") or a.get("first_step_time", a["time"]))
    first = int(a.get("resumed_step") or 0) + 1
    logged = [r["time"] for r in steps if "loss" in r and int(r["step"]) == first and r["time"] >= t - 1e-3
              and (nxt is None or r["time"] < nxt["time"])]
    return min(logged, default=t)


def _steps_after_first(mine: list[dict], first_end: float, resumed: int, kept: Optional[int]) -> int:
    """Steps an attempt kept after its first (those its productive seconds are of); `kept`: its last step the next
    attempt kept, logged or not."""
    last = max((int(r["step"]) for r in mine if "loss" in r and r["time"] > first_end + 1e-3), default=resumed + 1)
    return max(0, max(last, kept or 0) - resumed - 1)


def _why(events: list[dict], since: float, until: float) -> str:
    """Why a new group started, from the previous group's first step (a grow is decided while it trains, steps before
    its checkpoint) to its own start: a worker lost (restart, published once the group failed) wins over a decision
    to grow (resize)."""
    seen = {e.get("event") for e in events if since <= e["time"] <= until}
    return "resize" if "grow" in seen and not seen & {"lost_node", "reclaimed"} else "restart"


def _waits(events: list[dict], t_end: float) -> list[tuple[float, float]]:
    """Intervals below MIN: from each `waiting` to the next `capacity_back`, or its submission's end (a wait that
    timed out), or the end."""
    out, since = [], None
    for e in events:
        if e.get("event") == "waiting" and since is None:
            since = e["time"]
        elif e.get("event") in ("capacity_back", "ended") and since is not None:
            out.append((since, e["time"]))
            since = None
    if since is not None:
        out.append((since, t_end))
    return out


def _gap(a: dict, since: float, first_end: float, *, first: bool, noticed: bool = False) -> list[tuple[str, float, float]]:
    """The phases from `since` (submission, or the previous attempt's last step) to this attempt's first step's end:
    [(phase, from, to)], in order, each clipped to the gap. `noticed`: the previous attempt ended on a preemption
    notice's checkpoint, after which its ranks held until the node went (`notice`, not `detect`)."""
    ctl = a.get("controller") or {}
    boot = {k: a["time"] + v for k, v in (a.get("startup_s") or {}).items()}
    lead = "driver" if first else ("notice" if noticed else "detect")
    marks = [(lead, ctl.get("group_starting") if first else ctl.get("fault_detected")),
             ("teardown", ctl.get("group_torn_down")), ("schedule", ctl.get("group_starting")),
             ("workers", a["time"]), ("restore", boot.get("resume_point")),  # finding, fetching, converting it
             ("setup", boot.get("engine")), ("restore", boot.get("restore")), ("first_step", first_end)]
    out, t = [], since
    for phase, until in marks:
        if until is None:
            continue
        until = min(max(until, t), first_end)
        out.append((phase, t, until))
        t = until
    return out


def _add_gap(sec: dict, kind: str, gap: list[tuple[str, float, float]], waits: list[tuple[float, float]]) -> float:
    """A start / restart / resize gap into the ledger, the seconds of it spent below MIN as waiting (whichever phase
    the controller waited in); returns the gap's seconds."""
    for phase, t0, t1 in gap:
        w = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in waits)
        if w:
            sec["waiting"] = sec.get("waiting", 0.0) + w
        sec[f"{kind}/{phase}"] = sec.get(f"{kind}/{phase}", 0.0) + (t1 - t0) - w
    return sum(t1 - t0 for _, t0, t1 in gap)


def _own_beat(a: dict, nxt: Optional[dict]) -> Optional[dict]:
    """The heartbeat this attempt left, as the next attempt read it (None: none, or an older attempt's)."""
    beat = (nxt or {}).get("previous_progress") or {}
    return beat if beat.get("step_time") and beat.get("time", 0) >= a["time"] else None


def _attempt_end(a: dict, nxt: Optional[dict], t_end: float, later: list[dict], beat: Optional[dict]) -> float:
    """When an attempt stopped training: its last step (its heartbeat) and that step's records written after it, before
    the next group started (its log line, evaluation, checkpoint: a preemption notice's or a grow's is taken at the
    last step); the last attempt's, its last record (`later`: the records from its first step on); else the next
    group's fault seen or start."""
    if nxt is None:
        return min(max((r["time"] for r in later), default=t_end), t_end)
    if beat is not None:
        after = [r["time"] for r in later if int(r.get("step") or 0) <= int(beat["step"]) and r["time"] < nxt["time"]]
        return max([float(beat["step_time"])] + after)
    return float(nxt.get("controller", {}).get("fault_detected") or nxt.get("time") or t_end)


def _training(mine: list[dict], first_end: float, end: float, *, resumed: int, last: Optional[int],
              kept_to: Optional[int]) -> dict[str, float]:
    """An attempt's training window split into kinds: its kept steps by phase (its first step belongs to the start's
    `first_step` phase; a log record stands for the steps since the previous one, its figures being that window's
    means), evaluations, checkpoint stalls, and the steps after its last log record up to `end`: kept, or redone past
    `kept_to` (the step the next attempt resumed from; None: the last attempt, all kept). `last`: its last step (from
    its heartbeat; None: unknown, all redone)."""
    out = {k: 0.0 for k in STEP_KINDS}
    last_log, last_step = first_end, resumed + 1
    # An evaluation runs after its log record's window closed: its seconds are in the next window's step time.
    carried = 0.0
    stalls = after = 0.0  # checkpoint stalls no window has counted yet; seconds after the last log not on steps
    for r in mine:
        ev = float(r.get("eval_s") or 0.0)
        if "loss" in r and r["time"] <= first_end + 1e-3:
            # The first step's own record ends the start's first_step phase, an evaluation at that step included
            # (whose seconds the next window's step time holds too).
            carried = ev
            continue
        out["evaluation"] += ev
        if "loss" in r:
            step = int(r["step"])
            n = max(1, step - last_step)
            last_step = step
            d = float(r.get("step_time_s") or 0.0) * n
            wait = float(r.get("phase_data_wait_s") or 0.0) * n
            stall = float(r.get("phase_checkpoint_stall_s") or 0.0) * n
            out["data_wait"] += wait
            out["checkpoint_stall"] += stall
            out["productive"] += max(0.0, d - wait - stall - carried)
            last_log, carried, stalls, after = r["time"], ev, 0.0, 0.0
        else:  # an evaluation or a checkpoint between log steps (its stall, in the next window if there is one)
            stall = float(r.get("ckpt_stall_s") or 0.0)
            carried, stalls, after = carried + ev, stalls + stall, after + ev + stall
    out["checkpoint_stall"] += stalls
    tail = max(0.0, end - last_log - after)  # unlogged steps: kept up to kept_to, the rest redone
    kept = _kept_share(last_step, last, kept_to)
    out["productive"] += tail * kept
    out["redone"] += tail * (1 - kept)
    return out


def _kept_share(logged: int, last: Optional[int], kept_to: Optional[int]) -> float:
    """The share of the steps after the last logged one, up to the attempt's `last`, that the next attempt kept (it
    resumed from `kept_to`): all for the last attempt, none where the last step is unknown, else by step count (a
    memory snapshot or a notice's checkpoint can be newer than the last log line)."""
    if kept_to is None:
        return 1.0
    if last is None or kept_to <= logged:
        return 0.0
    return 1.0 if last <= logged else min(1.0, (kept_to - logged) / (last - logged))


def _idle(sec: dict, events: list[dict], span: tuple[float, float], waits: list[tuple[float, float]], *,
          kind: str) -> None:
    """A span in which no group trained into the ledger: `kind` (`finish` from an attempt's last step,
    `start/unfinished` from a submission) until that submission ended, then `not_running` until the next submission,
    then `start/unfinished` (none of its groups reached a first step within the span); seconds below MIN as waiting."""
    t, until = span
    marks = sorted((e["time"], e["event"]) for e in events
                   if e.get("event") in ("submitted", "ended") and t < e["time"] < until)
    for when, event in marks + [(until, None)]:
        if when > t:
            w = 0.0 if kind == "not_running" else sum(max(0.0, min(when, b) - max(t, a)) for a, b in waits)
            if w:
                sec["waiting"] = sec.get("waiting", 0.0) + w
            sec[kind] = sec.get(kind, 0.0) + (when - t) - w
        t, kind = max(t, when), "not_running" if event == "ended" else "start/unfinished"


def format_ledger(g: dict) -> str:
    """The ledger as lines a person reads."""
    wall = g["wall_s"]
    lines = [f"goodput {g['goodput']:.1%} of {wall:,.1f} s wall time ({len(g['attempts'])} attempt(s), sizes "
             + (" -> ".join(str(a["world_size"]) for a in g["attempts"]) or "none trained") + ")"]
    for k, v in g["seconds"].items():
        if v > 0:
            lines.append(f"  {k:22} {v:>10.1f} s  {v / wall:6.1%}" if wall else f"  {k:22} {v:>10.1f} s")
    return "\n".join(lines)
