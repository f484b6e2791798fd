"""Downstream evaluation with EleutherAI's lm-evaluation-harness: task checks, one Ray task per evaluation, eval/<step>/<task>.json.

The harness scores the model exactly as its own CLI would (`lm_eval --model hf pretrained=<export>`): a
checkpoint is first exported to a plain Hugging Face directory (raytrain.export), then handed to the harness's
`hf` model with the same arguments. The `lm-eval` package is an optional extra, imported only in here.
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Callable, Optional

from raytrain import storage
from raytrain.errors import UserError
from raytrain.rundir import EVAL, RunDir

from raytrain.eval_tasks import INSTALL, check_tasks, harness, offline, task_manager  # noqa: F401 - where callers find them


def metric_values(task_result: dict) -> dict[str, float]:
    """The harness's {"acc,none": 0.5, "acc_stderr,none": ...} as {"acc": 0.5, "acc_stderr": ...}; a metric under a
    filter other than "none" keeps it as metric/filter."""
    out = {}
    for key, v in task_result.items():
        if "," not in key or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        metric, filt = key.split(",", 1)
        out[metric if filt == "none" else f"{metric}/{filt}"] = float(v)
    return out


def run_harness(model_dir: str, *, tasks: list[str], limit: Optional[int], num_fewshot: Optional[int],
                include_path: Optional[str], batch_size: int, device: str,
                samples: Optional[dict[str, list[int]]] = None) -> dict:
    """The harness's `simple_evaluate` on a Hugging Face model directory: {task: {metric: value}} plus its samples
    counts and version. The arguments are the CLI's for `--model hf --model_args pretrained=<dir>`; `samples`: only
    these documents of each task (the harness's --samples, instead of --limit)."""
    offline()
    lm_eval = harness()
    res = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": model_dir}, tasks=list(tasks),
                                  num_fewshot=num_fewshot, limit=None if samples else limit, samples=samples,
                                  batch_size=batch_size, device=device,
                                  task_manager=task_manager(include_path, tasks), log_samples=False)
    return {"metrics": {t: metric_values(res["results"][t]) for t in tasks},
            "n_samples": {t: res.get("n-samples", {}).get(t) for t in tasks},
            "harness_version": getattr(lm_eval, "__version__", None)}


def write_results(run_uri: str, step: int, out: dict, *, source: str, settings: dict) -> list[str]:
    """eval/<step>/<task>.json in the run directory, one per task; returns their URIs."""
    rd, uris = RunDir(run_uri), []
    for task, metrics in out["metrics"].items():
        rec = {"task": task, "step": step, "source": source, "metrics": metrics, "n_samples": out["n_samples"][task],
               "harness_version": out["harness_version"], **settings, "finished": time.time()}
        uri = rd.uri(EVAL, str(step), f"{task}.json")
        storage.write_text(uri, json.dumps(rec, indent=1))
        uris.append(uri)
    return uris


def read_results(run_uri: str, step: int, tasks: list[str]) -> Optional[dict[str, dict]]:
    """{task: metrics} when every task's result for `step` is in the run directory, else None."""
    rd, found = RunDir(run_uri), {}
    for task in tasks:
        rec = rd.read_json(storage.join(EVAL, str(step), f"{task}.json"))
        if not rec or "metrics" not in rec:
            return None
        found[task] = rec["metrics"]
    return found


def evaluate_model(*, checkpoint: Optional[str], model_dir: Optional[str], eval_cfg, run_uri: Optional[str],
                   device: str = "cpu") -> dict:
    """Export the checkpoint (when given one), run the harness, write eval/<step>/<task>.json when the run is known.
    Runs inside a Ray task."""
    from raytrain.export import export

    settings = {"limit": eval_cfg.limit, "num_fewshot": eval_cfg.num_fewshot, "batch_size": eval_cfg.batch_size}
    with tempfile.TemporaryDirectory(prefix="raytrain-lmeval-") as d:
        if checkpoint is not None:
            step = export(checkpoint, d, force=True, log=lambda *_: None)["step"]
            model_dir = d
        else:
            step = _export_meta(model_dir).get("step")
        from raytrain.model import local_model_dir

        kw = dict(num_fewshot=eval_cfg.num_fewshot, include_path=eval_cfg.include_path,
                  batch_size=eval_cfg.batch_size, device=device)
        out = run_harness(local_model_dir(model_dir), tasks=eval_cfg.tasks, limit=eval_cfg.limit, **kw)
        clean = {t: ids for t, ids in clean_subset(eval_cfg.clean_subset).items() if t in eval_cfg.tasks and ids}
        if clean:  # the same tasks on their uncontaminated examples only, beside the whole
            got = run_harness(local_model_dir(model_dir), tasks=list(clean), limit=None, samples=clean, **kw)
            out["metrics"].update({f"{t}/clean": m for t, m in got["metrics"].items()})
            out["n_samples"].update({f"{t}/clean": n for t, n in got["n_samples"].items()})
    out.update(step=step, source=checkpoint or model_dir, written=[])
    if run_uri is not None and step is not None:
        out["written"] = write_results(run_uri, step, out, source=out["source"], settings=settings)
    return out


def clean_subset(uri: Optional[str]) -> dict[str, list[int]]:
    """{task: indexes of its clean examples} from a `raytrain data contamination --clean-out` file ({} for None);
    a missing or malformed one is a one-line UserError."""
    if not uri:
        return {}
    try:
        got = json.loads(storage.read_text(storage.absolute(uri)))
    except (OSError, ValueError) as e:
        raise UserError(f"eval.clean_subset={uri}: not a readable JSON file ({type(e).__name__}); write it with "
                        "`raytrain data contamination DATA --tasks ... --clean-out FILE`") from None
    if not isinstance(got, dict) or not all(isinstance(v, list) and all(isinstance(i, int) for i in v)
                                            for v in got.values()):
        raise UserError(f"eval.clean_subset={uri}: expected {{task: [example indexes]}}, as `raytrain data "
                        "contamination --clean-out` writes")
    return got


def _export_meta(model_dir: str) -> dict:
    from raytrain.export import EXPORT_META

    uri = storage.join(storage.absolute(model_dir), EXPORT_META)
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else {}


def run_of_export(model_dir: str) -> Optional[str]:
    """The run directory a raytrain export came from (its source checkpoint's parent), if it says."""
    src = _export_meta(model_dir).get("source_checkpoint")
    return src.rsplit("/", 1)[0] if src else None


def resources(eval_cfg, cluster: dict) -> dict:
    """What an evaluation task asks Ray for: eval.resources, or one CPU and, where the cluster has GPUs, one GPU (so
    it never shares a training worker's device: Ray gives each GPU to one holder)."""
    if eval_cfg.resources is not None:
        return dict(eval_cfg.resources)
    return {"CPU": 1.0, **({"GPU": 1.0} if cluster.get("GPU", 0) > 0 else {})}


def submit(*, checkpoint: Optional[str], model_dir: Optional[str], eval_cfg, run_uri: Optional[str]):
    """One evaluation as a Ray task with resources of its own; returns its ObjectRef (never waited on here)."""
    import ray

    want = resources(eval_cfg, ray.cluster_resources())
    opts = {"num_cpus": want.pop("CPU", 1.0), "num_gpus": want.pop("GPU", 0.0), "resources": want or None,
            "max_retries": 0}
    task = ray.remote(**opts)(_evaluate_task)
    return task.remote(checkpoint=checkpoint, model_dir=model_dir, eval_cfg=eval_cfg, run_uri=run_uri,
                       gpus=opts["num_gpus"])


def _evaluate_task(*, checkpoint, model_dir, eval_cfg, run_uri, gpus: float) -> dict:
    import torch

    torch.set_num_threads(1)  # one CPU, as scheduled
    return evaluate_model(checkpoint=checkpoint, model_dir=model_dir, eval_cfg=eval_cfg, run_uri=run_uri,
                          device="cuda" if gpus > 0 else "cpu")


def table(out: dict) -> str:
    """The results as the harness prints them, in short: task | metric | value."""
    rows = [f"{'task':<28} {'metric':<20} value"]
    for task, metrics in out["metrics"].items():
        for m, v in metrics.items():
            if not m.endswith("_stderr") and "_stderr/" not in m:
                err = metrics.get(f"{m}_stderr")
                rows.append(f"{task:<28} {m:<20} {v:.4f}" + (f" ± {err:.4f}" if isinstance(err, float) else ""))
    return "\n".join(rows)


def run_eval_command(args, *, log: Callable[[str], None] = print) -> dict:
    """`raytrain eval --tasks ...` on Ray: one evaluation task, its table printed, its results written to the run."""
    import ray

    from raytrain.config import EvalSection
    from raytrain.ray_connect import check_address, connect

    if (args.checkpoint is None) == (args.model is None):
        raise UserError("pass exactly one of --checkpoint URI or --model DIR")
    eval_cfg = EvalSection(tasks=[t for t in args.tasks.split(",") if t], limit=args.limit,
                           num_fewshot=args.num_fewshot, include_path=args.include_path, batch_size=args.batch_size,
                           clean_subset=args.clean)
    check_tasks(eval_cfg.tasks, eval_cfg.include_path)
    clean_subset(eval_cfg.clean_subset)  # a bad file: one line now, not in the evaluation task
    check_address("eval")
    run_uri = storage.absolute(args.checkpoint).rsplit("/", 1)[0] if args.checkpoint else run_of_export(args.model)
    if run_uri is not None and not storage.exists(run_uri):
        run_uri = None  # an export whose run directory is elsewhere (or gone): results are printed only
    started = connect("eval", worker_logs=False)
    try:
        out = ray.get(submit(checkpoint=args.checkpoint, model_dir=args.model, eval_cfg=eval_cfg, run_uri=run_uri))
    finally:
        if started:
            ray.shutdown()
    log(f"[raytrain] {out['source']} (step {out['step']}): lm-evaluation-harness {out['harness_version']}, "
        f"limit {eval_cfg.limit}, {eval_cfg.num_fewshot or 0}-shot")
    log(table(out))
    for uri in out["written"]:
        log(f"[raytrain] wrote {uri}")
    return out
