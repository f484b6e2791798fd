"""`raytrain report RUN_URI`: a PNG of loss, perplexity and throughput over steps and a Markdown summary of a run,
both from its metrics.jsonl, summary.json, attempts.jsonl and restores.jsonl (local or s3://); restarts (with where
each restored from) and rollbacks are marked."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from raytrain import storage
from raytrain.errors import UserError
from raytrain.ckpt.layout import step_of
from raytrain.rundir import METRICS, MIXTURE, REPORT_GOODPUT, REPORT_MD, REPORT_PNG, RESTORES, SUMMARY, RunDir


def load_records(run_uri: str) -> list[dict]:
    uri = storage.join(run_uri, METRICS)
    if not storage.exists(uri):
        raise UserError(f"no {METRICS} in {run_uri}: is it a run directory (<checkpoint.storage>/<run.name>)?")
    recs = []
    for line in storage.read_text(uri).splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
    return recs


def _series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in recs
           if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def restarts(run_uri: str) -> list[dict]:
    """Each restart of the run (attempts.jsonl): the step it resumed at, the steps redone and the wall seconds
    lost, counted the way `raytrain cost` counts them (one source for both)."""
    from raytrain.cost import Prices, report as cost_report

    rows = cost_report(run_uri, Prices(0.0, 0.0, 0.0))["restarts"]
    restores = [r for r in RunDir(run_uri).read_jsonl(RESTORES) if r.get("ok")]
    for i, r in enumerate(rows, start=1):
        r["attempt"] = i
        r["source"] = _restore_source(restores, r["resumed_step"])
        # Work thrown away (trained past the checkpoint, then redone) plus the time until training resumed.
        r["wall_lost_s"] = round(r["lost_s"] + max(0.0, r["recovery_s"]), 1)
    return rows


def _restore_source(restores: list[dict], step: int) -> str:
    """Where the restart at `step` restored from (restores.jsonl, consumed in order): memory:local / memory:peer /
    storage; records of older versions name no source (storage) or no step (their checkpoint's)."""
    for i, r in enumerate(restores):
        if r.get("step", step_of(r.get("checkpoint") or "")) == step:
            return restores.pop(i).get("source", "storage")
    return "none (fresh start)" if step == 0 else "-"


def plot(recs: list[dict], title: str, path: str, restarted: tuple[dict, ...] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    rollbacks = [r for r in recs if r.get("event") == "rollback"]
    panels = [
        (axes[0], "loss", [("loss", "train loss", "-"), ("val_loss", "val loss", "o-")], False),
        (axes[1], "perplexity (log scale)", [("ppl", "train ppl", "-"), ("val_ppl", "val ppl", "o-")], True),
        (axes[2], "tokens / s", [("tokens_per_s", "tokens/s (whole run)", "-")], False),
    ]
    for ax, ylabel, series, log in panels:
        for key, label, style in series:
            xs, ys = _series(recs, key)
            if key == "ppl" and not xs:  # older runs: derive it from the loss
                xs, ys = _series(recs, "loss")
                ys = [math.exp(min(v, 50)) for v in ys]
            if xs:
                ax.plot(xs, ys, style, label=label, markersize=4)
        for rb in rollbacks:
            ax.axvline(rb.get("bad_step", rb["step"]), color="red", linestyle=":", alpha=0.7)
        for rs in restarted:
            ax.axvline(rs["resumed_step"], color="tab:orange", linestyle="--", alpha=0.8)
        if log and ax.lines:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    if rollbacks:
        axes[0].plot([], [], color="red", linestyle=":", label="rollback (bad step)")
    if restarted:
        axes[0].plot([], [], color="tab:orange", linestyle="--", label="restart (step resumed at)")
    if rollbacks or restarted:
        axes[0].legend(loc="best")
    axes[2].set_xlabel("optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_goodput(g: dict, recs: list[dict], title: str, path: str) -> None:
    """One picture of the ledger: the world size and the steps over wall time (waits shaded), badput by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = g["submitted"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), gridspec_kw={"height_ratios": [3, 2]})
    xs, ys = [0.0], [0]
    for a in g["attempts"]:
        xs += [a["start"] - t0, a["first_step"] - t0, a["end"] - t0]
        ys += [0, a["world_size"], a["world_size"]]
    xs.append(g["ended"] - t0)
    ys.append(0)
    top.step(xs, ys, where="post", color="tab:blue", label="workers training")
    top.set_ylabel("workers")
    top.set_xlabel("seconds since submission")
    steps = [(r["time"] - t0, r["step"]) for r in recs if "loss" in r and "time" in r]
    if steps:
        right = top.twinx()
        right.plot(*zip(*steps), ".", color="tab:green", markersize=3, label="step (final timeline)")
        right.set_ylabel("optimizer step")
    top.set_title(f"goodput {g['goodput']:.1%} of {g['wall_s']:,.0f} s")
    top.grid(True, alpha=0.3)
    top.legend(loc="upper left")
    bad = [(k, v) for k, v in g["seconds"].items() if k != "productive" and v > 0]
    bottom.barh([k for k, _ in bad][::-1], [v for _, v in bad][::-1], color="tab:red")
    bottom.set_xlabel("badput seconds by kind (productive: " + f"{g['seconds'].get('productive', 0):,.1f} s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goodput_lines(g: Optional[dict]) -> list[str]:
    """The report's goodput section."""
    if g is None:
        return ["## Goodput", "", "No ledger (the run has no submission event: trained before the ledger existed).", ""]
    wall = g["wall_s"] or 1.0
    out = ["## Goodput", "", f"![size and goodput over time]({REPORT_GOODPUT})", "",
           f"Goodput {g['goodput']:.1%} of {g['wall_s']:,.1f} s of wall time; sizes "
           + " -> ".join(str(a["world_size"]) for a in g["attempts"]) + ".", "",
           "| kind | seconds | share |", "| --- | --- | --- |"]
    out += [f"| {k} | {v:,.1f} | {v / wall:.1%} |" for k, v in g["seconds"].items() if v > 0]
    return out + [""]


def _f(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def mixture_lines(s: dict, recs: list[dict], recorded: list[dict]) -> list[str]:
    """A data mixture's sources: weight schedule (as recorded, with changes on resume), realised share of the
    slots trained, tokens, passes over each source's data, last validation loss; nothing for one split."""
    names = [k.split("/", 1)[1] for k in s if k.startswith("share/")] or \
        sorted({k.split("/", 1)[1] for r in recs for k in r if k.startswith("share/")})
    if not names:
        return []
    last = lambda k: s.get(k, next((r[k] for r in reversed(recs) if isinstance(r.get(k), (int, float))), None))  # noqa: E731
    out = ["## Data mixture", ""]
    for rec in recorded:
        stages = "; ".join(f"from step {st}: " + ", ".join(f"{n} {w:g}" for n, w in zip(names, ws))
                           for st, ws in rec["stages"])
        out.append(f"- {'set' if rec['from_step'] == 0 else 'changed on resume'} at step {rec['from_step']}: {stages}")
    out += ["", "| source | realised share | tokens | epochs (passes) | val loss (last) |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {n} | {_f(last(f'share/{n}'), '.2%')} | {_f(last(f'tokens_seen/{n}'), ',')} | "
            f"{_f(last(f'epochs/{n}'), '.3f')} | {_f(last(f'val_loss/{n}'), '.4f')} |" for n in names]
    return out + [""]


BAD_BATCH_DOCS = 20  # documents listed per rolled-back batch (the trace command lists them all)


def bad_batch_documents(run_uri: str, recs: list[dict]) -> dict[int, list[str]]:
    """Per rollback (its bad step), the documents of the batch it skipped, one line each, from the data's
    provenance (raytrain/data/trace.py); a line saying why where they cannot be named."""
    rolled = [r for r in recs if r.get("event") == "rollback" and r.get("bad_batch")]
    if not rolled:
        return {}
    from raytrain.data.trace import RunData, documents

    out: dict[int, list[str]] = {}
    try:
        run = RunData(run_uri)
        for r in rolled:
            got = documents(run, int(r["bad_batch"][0]))
            seen: dict = {}
            for row in got["rows"]:
                for sp in row["spans"]:
                    seen.setdefault((sp["source"], sp["record"]), sp["head"][:60])
            lines = [f"`{src}@{rec}` {head!r}" for (src, rec), head in list(seen.items())[:BAD_BATCH_DOCS]]
            if len(seen) > BAD_BATCH_DOCS:
                lines.append(f"... {len(seen) - BAD_BATCH_DOCS} more: `raytrain data trace {run_uri} "
                             f"--position {r['bad_batch'][0]}` lists them all")
            out[int(r["bad_step"])] = lines
    except UserError as e:  # data without provenance, or moved: the report still stands
        return {int(r["bad_step"]): [f"documents unknown: {e}"] for r in rolled}
    return out


def markdown(recs: list[dict], summary: Optional[dict], run_uri: str, png_name: str,
             restarted: tuple[dict, ...] = (), bad_docs: Optional[dict] = None, goodput: Optional[dict] = None) -> str:
    s = summary or {}
    last = lambda k: next((r[k] for r in reversed(recs) if isinstance(r.get(k), (int, float))), None)  # noqa: E731
    first = lambda k: next((r[k] for r in recs if isinstance(r.get(k), (int, float))), None)  # noqa: E731
    steps = [r["step"] for r in recs if "loss" in r]
    tps = [r["tokens_per_s"] for r in recs if isinstance(r.get("tokens_per_s"), (int, float))]
    steady = tps[1:] or tps
    lines = [f"# Run report: {s.get('run', os.path.basename(run_uri.rstrip('/')))}", "",
             f"Run directory: `{run_uri}`" + ("" if summary else " (no summary.json: the run has not finished)"), "",
             f"![loss, perplexity and throughput]({png_name})", "",
             "| | |", "| --- | --- |",
             f"| steps | {s.get('steps', max(steps) if steps else '-')} |",
             f"| tokens seen | {_f(s.get('tokens_seen', last('tokens_seen')), ',')} |",
             f"| train loss (first -> last) | {_f(first('loss'), '.4f')} -> {_f(last('loss'), '.4f')} |",
             f"| val loss / ppl (first -> last) | {_f(first('val_loss'), '.4f')} / {_f(first('val_ppl'), '.2f')} -> "
             f"{_f(last('val_loss'), '.4f')} / {_f(last('val_ppl'), '.2f')} |",
             f"| tokens/s (mean after the first window) | {_f(sum(steady) / len(steady) if steady else None, ',.0f')} |",
             f"| achieved TFLOP/s per worker / MFU | {_f(last('tflops_per_worker'), '.4g')} / {_f(last('mfu'), '.2%')} |",
             f"| grad norm (last) | {_f(last('grad_norm'), '.3g')} |",
             f"| host RSS (last, GiB) | {_f(last('host_rss_gb'), '.2f')} |",
             f"| restarts / preemptions / rollbacks | {_f(s.get('restarts', last('restarts')), 'd')} / "
             f"{_f(last('preemptions'), 'd')} / {_f(s.get('rollbacks', last('rollbacks')), 'd')} |",
             f"| wall time | {_f(s.get('wall_s'), '.1f')} s |",
             f"| final checkpoint | {s.get('checkpoint') or '-'} |", ""]
    phases = {k[6:-2]: last(k) for k in ("phase_data_wait_s", "phase_forward_backward_s", "phase_optimizer_s",
                                          "phase_checkpoint_stall_s")}
    if any(v is not None for v in phases.values()):
        lines += ["Step time by phase at the last log step: " +
                  ", ".join(f"{k} {_f(v, '.4f')} s" for k, v in phases.items()), ""]
    lines += mixture_lines(s, recs, RunDir(run_uri).read_jsonl(MIXTURE))
    lines += goodput_lines(goodput)
    lines += ["## Restarts", ""]
    if not restarted:
        lines.append("No restarts.")
    else:
        lines += ["| restart | resumed at step | steps redone | wall s lost | of which recovery s | restored from |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['attempt']} | {r['resumed_step']} | {_f(r['lost_steps'], 'd')} | {_f(r['wall_lost_s'], '.1f')} "
                  f"| {_f(r['recovery_s'], '.1f')} | {r.get('source', '-')} |" for r in restarted]
    lines.append("")
    violations = s.get("health_violations") or {}
    rolled = [r for r in recs if r.get("event") == "rollback"]
    lines += ["## Health", ""]
    if not violations and not rolled:
        lines.append("No health-rule violations.")
    for rule, n in sorted(violations.items()):
        lines.append(f"- `{rule}`: {n}x, first: {(s.get('health_first') or {}).get(rule, '')}")
    for r in rolled:
        lines.append(f"- rollback at step {r.get('bad_step')} ({r.get('rule')}): back to step {r.get('resumed_from')}, "
                     f"samples {r['skipped'][0]}..{r['skipped'][1] - 1} skipped")
        docs = (bad_docs or {}).get(r.get("bad_step"))
        if docs:
            lines.append(f"  - documents of the bad batch (samples {r['bad_batch'][0]}..{r['bad_batch'][1] - 1}):")
            lines += [f"    - {d}" for d in docs]
    return "\n".join(lines) + "\n"


def report(run_uri: str, out: Optional[str] = None) -> tuple[str, str]:
    """Writes report.png and report.md into `out` (default: the run directory). Returns their URIs."""
    import tempfile

    from raytrain.goodput import ledger

    run_uri = storage.absolute(run_uri)
    recs = load_records(run_uri)
    if not any("loss" in r for r in recs):
        raise UserError(f"{storage.join(run_uri, METRICS)} has no training steps yet; nothing to plot")
    summary = RunDir(run_uri).read_json(SUMMARY)
    out = storage.absolute(out) if out else run_uri
    png, md = storage.join(out, REPORT_PNG), storage.join(out, REPORT_MD)
    with tempfile.TemporaryDirectory(prefix="raytrain-report-") as d:
        local = os.path.join(d, REPORT_PNG)
        name = (summary or {}).get("run") or os.path.basename(run_uri.rstrip("/"))
        restarted = tuple(restarts(run_uri))
        plot(recs, f"raytrain run {name}", local, restarted)
        storage.upload_file(local, png)
        g = ledger(run_uri)
        if g is not None:
            plot_goodput(g, recs, f"raytrain run {name}", os.path.join(d, REPORT_GOODPUT))
            storage.upload_file(os.path.join(d, REPORT_GOODPUT), storage.join(out, REPORT_GOODPUT))
    storage.write_text(md, markdown(recs, summary, run_uri, REPORT_PNG, restarted,
                                    bad_docs=bad_batch_documents(run_uri, recs), goodput=g))
    return png, md
