"""Sweep results: one row per trial sorted by objective (console table, CSV, JSON), the throughput plot,
and the best setting written as a training config that `raytrain train --config FILE` accepts as is."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Optional

from raytrain import storage
from raytrain.config import load_config
from raytrain.sweep.spec import SweepSpec, base_config, microbatch_grid, trial_config

_ORDER = {"completed": 0, "stopped": 1, "infeasible": 2, "error": 3}
_COLUMNS = ("step", "micro_batch_size", "accumulation", "tokens_per_s", "tflops_per_worker", "val_loss", "val_ppl",
            "memory_est_mb")


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def rows_from(result_grid, spec: SweepSpec) -> list[dict]:
    """One dict per trial: settings, objective value, status (completed / stopped / infeasible / error)."""
    metric, rows = spec.objective.metric, []
    budget = trial_config(spec, {}).run.max_steps
    for r in result_grid:
        m = r.metrics or {}
        row: dict[str, Any] = {"trial": m.get("trial_id") or str(r.path).rstrip("/").rsplit("/", 1)[-1],
                               "settings": dict(r.config or {}), metric: _num(m.get(metric))}
        row.update({k: m.get(k) for k in _COLUMNS if k != metric and m.get(k) is not None})
        if r.error is not None:
            row["status"], row["detail"] = "error", (str(r.error).strip().splitlines() or ["?"])[-1][:200]
        elif m.get("infeasible"):
            row["status"], row["detail"] = "infeasible", m.get("reason", "")
        elif m.get("final") or (m.get("step") or 0) >= budget:
            row["status"], row["detail"] = "completed", ""
        else:
            # The trial's last result is an intermediate one: the scheduler stopped it there.
            row["status"] = "stopped"
            row["detail"] = f"stopped early at step {m.get('step')}" if m else "stopped before its first report"
        if m.get("run_uri"):
            row["run_uri"] = m["run_uri"]
        rows.append(row)
    sign = -1 if spec.mode == "max" else 1
    rows.sort(key=lambda r: (_ORDER[r["status"]], r[metric] is None, sign * (r[metric] or 0.0)))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def best_row(rows: list[dict], spec: SweepSpec) -> Optional[dict]:
    done = [r for r in rows if r["status"] == "completed" and r[spec.objective.metric] is not None]
    return done[0] if done else None


def microbatch_summary(rows: list[dict], spec: SweepSpec) -> dict:
    """Trials used against the grid, and why the search stopped (the searcher's rule replayed on the rows)."""
    from raytrain.sweep.space import MicroBatchSearcher

    searcher = MicroBatchSearcher.from_spec(spec)
    for r in sorted(rows, key=lambda r: r.get("micro_batch_size") or 0):
        if r["status"] in ("completed", "infeasible") and searcher.stop_reason is None:
            searcher.record(r["micro_batch_size"], r[spec.objective.metric], r["status"] == "completed", r["detail"])
    grid = microbatch_grid(spec)
    reason = searcher.stop_reason or ("grid exhausted" if len(rows) >= len(grid) else "incomplete")
    return {"trials_used": len(rows), "grid_size": len(grid), "grid": grid, "stop_reason": reason}


def best_config_yaml(spec: SweepSpec, row: dict) -> str:
    """The base training config with the winning settings; trial-only short-run settings are left out."""
    settings = dict(row["settings"])
    if spec.search.method == "microbatch":
        settings.update({"batch.global_batch_size": base_config(spec).global_batch,
                         "batch.gradient_accumulation_steps": row.get("accumulation")})
    cfg = load_config(spec.base, {**spec.overrides, **settings, "run.name": f"{spec.name}-best"})
    pretty = ", ".join(f"{k}={v}" for k, v in row["settings"].items())
    header = (f"# Best setting of sweep {spec.name} (trial {row['trial']}, {spec.objective.metric}="
              f"{row[spec.objective.metric]:.6g}): {pretty}\n# Train it: raytrain train --config <this file>\n")
    return header + cfg.to_yaml()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict], spec: SweepSpec) -> str:
    keys = sorted({k for r in rows for k in r["settings"]})
    metric = spec.objective.metric
    extra = [c for c in _COLUMNS if c != metric and any(c in r for r in rows)]
    header = ["rank", "trial", "status", metric, *keys, *extra, "detail"]
    body = [[_fmt(r["rank"]), r["trial"], r["status"], _fmt(r[metric]), *(_fmt(r["settings"].get(k)) for k in keys),
             *(_fmt(r.get(c)) for c in extra), r.get("detail", "")] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def to_csv(rows: list[dict], spec: SweepSpec) -> str:
    keys = sorted({k for r in rows for k in r["settings"]})
    metric = spec.objective.metric
    fields = ["rank", "trial", "status", metric, *keys, *[c for c in _COLUMNS if c != metric], "detail", "run_uri"]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**{k: r.get(k) for k in fields}, **r["settings"]})
    return out.getvalue()


def throughput_png(rows: list[dict], spec: SweepSpec, summary: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = spec.objective.metric
    ok = sorted((r["micro_batch_size"], r[metric]) for r in rows if r["status"] == "completed" and r[metric] is not None)
    bad = sorted(r["micro_batch_size"] for r in rows if r["status"] == "infeasible")
    fig, ax = plt.subplots(figsize=(6, 4))
    if ok:
        ax.plot([x for x, _ in ok], [y for _, y in ok], "o-", label=metric)
    for x in bad:
        ax.axvline(x, color="tab:red", linestyle="--", label=f"infeasible (memory) mb={x}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(summary["grid"], [str(m) for m in summary["grid"]])
    ax.set_xlabel("micro-batch size (global batch fixed)")
    ax.set_ylabel(metric)
    ax.set_title(f"{spec.name}: {summary['trials_used']} trials of a {summary['grid_size']}-point grid")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_all(rows: list[dict], spec: SweepSpec, sweep_dir: str) -> dict:
    """results.json / results.csv (+ throughput.png, best_config.yaml) in the sweep directory."""
    best = best_row(rows, spec)
    out: dict[str, Any] = {"sweep": spec.name, "sweep_dir": sweep_dir,
                           "objective": {"metric": spec.objective.metric, "mode": spec.mode},
                           "best": None, "best_config": None, "trials": rows}
    if spec.search.method == "microbatch":
        out["microbatch"] = microbatch_summary(rows, spec)
        out["plot"] = storage.join(sweep_dir, "throughput.png")
        storage.write_bytes(out["plot"], throughput_png(rows, spec, out["microbatch"]))
    if best is not None:
        out["best"] = best
        out["best_config"] = storage.join(sweep_dir, "best_config.yaml")
        text = best_config_yaml(spec, best)
        storage.write_text(out["best_config"], text)
        if storage.is_remote(sweep_dir):
            # `raytrain train --config` reads local files: keep a copy next to where the sweep was started.
            out["best_config"] = storage.absolute(f"{spec.name}.best_config.yaml")
            storage.write_text(out["best_config"], text)
    storage.write_text(storage.join(sweep_dir, "results.csv"), to_csv(rows, spec))
    storage.write_text(storage.join(sweep_dir, "results.json"), json.dumps(out, indent=1, default=str))
    return out
