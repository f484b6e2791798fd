"""The sweep config: base training config + search space (same dotted keys) + objective, scheduler, budget, resources.

Loaded from YAML (tune_configs/*.yaml) with dotted overrides on top, and checked completely before any
trial starts: unknown keys, training keys the space names, values the training config would refuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raytrain import config as tcfg
from raytrain.config import Config
from raytrain.errors import UserError

# What a trial can report, and which direction is better. Throughput comes from the run's summary;
# val_* from its evaluations (intermediate reports, which ASHA needs).
METRICS = {"val_loss": "min", "val_ppl": "min", "loss": "min",
           "tokens_per_s": "max", "samples_per_s": "max", "tflops_per_worker": "max"}
DIMENSIONS = ("loguniform", "uniform", "randint", "choice", "grid")
MICRO_BATCH_KEY = "batch.micro_batch_size"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Objective(_Section):
    """What the sweep optimises."""

    metric: str = Field("val_loss", description=f"one of: {', '.join(METRICS)}")
    mode: Optional[Literal["min", "max"]] = Field(None, description="null: the metric's natural direction")


class Search(_Section):
    """How trial settings are chosen."""

    method: Literal["random", "grid", "microbatch"] = Field(
        "random", description="random: sample `space` num_samples times; grid: every combination of `grid` lists; "
        "microbatch: adaptive powers-of-two micro-batch search with the global batch held fixed")
    seed: int = Field(0, ge=0, description="seed of the random search (same seed, same trial settings)")


class MicroBatch(_Section):
    """The adaptive micro-batch search (search.method=microbatch), after DeepSpeed's autotuner."""

    min: int = Field(1, ge=1, description="smallest micro-batch tried")
    max: Optional[int] = Field(None, ge=1, description="largest micro-batch tried; null: global batch / workers")
    plateau_pct: Optional[float] = Field(5.0, description="stop growing when throughput gains less than this "
                                         "(percent) over the best so far; null: grow until memory or the grid ends")
    memory_cap_mb: Optional[float] = Field(None, gt=0, description="per-worker accelerator memory budget; a trial "
                                           "whose estimate (or measured peak) exceeds it is infeasible")


class Scheduler(_Section):
    """Trial scheduler. ASHA stops trials whose objective lags at its rungs (budget in optimizer steps)."""

    type: Literal["fifo", "asha"] = Field("fifo", description="fifo: run every trial to the end; asha: early stopping")
    grace_period: int = Field(10, ge=1, description="asha: steps every trial runs before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1.0, description="asha: keep 1/reduction_factor of trials at each rung")


class Budget(_Section):
    """How much the sweep may spend."""

    max_steps: Optional[int] = Field(None, ge=1, description="optimizer steps per trial (asha's max_t); null: "
                                     "the base config's run.max_steps")
    num_samples: int = Field(1, ge=1, description="random: trials to sample; grid: repeats of the grid")


class Resources(_Section):
    """Trial concurrency follows from the cluster: each trial needs its workers' CPUs/GPUs plus Ray Data's CPUs."""

    max_concurrent: Optional[int] = Field(None, ge=1, description="upper bound on trials at once; null: what the "
                                          "cluster fits")
    driver_cpus: float = Field(0.01, gt=0, description="logical CPUs of each trial's driver (it only waits on "
                               "its Train run)")


class SweepSpec(_Section):
    """A whole sweep."""

    name: str = Field("sweep", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="sweep directory name")
    base: str = Field("tiny", description="training config: recipe name or path to a YAML file")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted training keys applied to every "
                                      "trial and to the written best config")
    trial_overrides: dict[str, Any] = Field(default_factory=dict, description="dotted training keys for trials only "
                                            "(short-run settings), not written into the best config")
    storage: Optional[str] = Field(None, description="where the sweep lives (local or s3://); null: "
                                   "<checkpoint.storage>/sweeps. Sweep dir: <storage>/<name>")
    space: dict[str, dict[str, Any]] = Field(default_factory=dict, description="dotted training key -> "
                                             "{loguniform|uniform|randint: [lo, hi]} or {choice|grid: [values]}")
    objective: Objective = Field(default_factory=Objective)
    search: Search = Field(default_factory=Search)
    microbatch: MicroBatch = Field(default_factory=MicroBatch)
    scheduler: Scheduler = Field(default_factory=Scheduler)
    budget: Budget = Field(default_factory=Budget)
    resources: Resources = Field(default_factory=Resources)

    @model_validator(mode="after")
    def _objective_known(self) -> "SweepSpec":
        if self.objective.metric not in METRICS:
            raise ValueError(f"objective.metric={self.objective.metric!r} is not reported by trials "
                             f"(allowed: {', '.join(METRICS)})")
        return self

    @property
    def mode(self) -> str:
        return self.objective.mode or METRICS[self.objective.metric]


def _resolve_path(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    candidate = Path("tune_configs") / f"{name_or_path}.yaml"
    if p.suffix not in (".yaml", ".yml") and candidate.is_file():
        return candidate
    raise UserError(f"tune config not found: {name_or_path} (pass a path such as tune_configs/NAME.yaml)")


def load_spec(name_or_path: Optional[str], overrides: Optional[list[str]] = None) -> SweepSpec:
    """YAML + dotted overrides -> a checked SweepSpec. Training keys (model.*, optim.*, ...) given on the
    command line go to `overrides`; the rest address the sweep config itself (budget.max_steps=20)."""
    spec = tcfg.load_tree(_resolve_path(name_or_path) if name_or_path else None, overrides or [], root=SweepSpec,
                          what="tune config", top_level="(name:, base:, space:, ...)", place=_place_overrides)
    check(spec)
    return spec


def _place_overrides(tree: dict, overrides: dict[str, Any]) -> dict:
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in Config.model_fields and rest:  # (a bare `storage=` is the sweep's; `storage.sse=` training's)
            tree.setdefault("overrides", {})[key] = value
        elif head in ("space", "overrides", "trial_overrides") and rest:
            tree.setdefault(head, {})[rest] = value  # their keys are dotted training keys
        elif head in SweepSpec.model_fields:
            tree = tcfg.apply_overrides(tree, {key: value})
        else:
            raise UserError(f"unknown key {key!r}: neither a training config key ({', '.join(Config.model_fields)}) "
                            f"nor a tune config key ({', '.join(SweepSpec.model_fields)})")
    return tree


def base_config(spec: SweepSpec) -> Config:
    """The training config the best setting is written on: base + overrides (no trial-only settings)."""
    return tcfg.load_config(spec.base, dict(spec.overrides))


def trial_overrides(spec: SweepSpec, settings: dict[str, Any]) -> dict[str, Any]:
    """Dotted overrides of one trial, on top of the base recipe."""
    ov = {**spec.overrides, **spec.trial_overrides}
    if spec.budget.max_steps is not None:
        ov["run.max_steps"] = spec.budget.max_steps
    if spec.search.method == "microbatch":
        # The global batch is held fixed; accumulation follows from the micro-batch.
        ov.update({"batch.global_batch_size": base_config(spec).global_batch,
                   "batch.gradient_accumulation_steps": None})
    ov.update(settings)
    return ov


def trial_config(spec: SweepSpec, settings: dict[str, Any]) -> Config:
    return tcfg.load_config(spec.base, trial_overrides(spec, settings))


def microbatch_grid(spec: SweepSpec) -> list[int]:
    """Powers of two from microbatch.min that divide the per-worker share of the fixed global batch."""
    cfg = base_config(spec)
    per_worker = cfg.global_batch // cfg.scaling.num_workers
    top = min(spec.microbatch.max or per_worker, per_worker)
    grid, m = [], 1
    while m <= top:
        if m >= spec.microbatch.min and per_worker % m == 0:
            grid.append(m)
        m *= 2
    return grid


def _dimension_values(key: str, dim: dict[str, Any]) -> list[Any]:
    """Representative values of a space dimension, for validating them against the training config."""
    if len(dim) != 1 or next(iter(dim)) not in DIMENSIONS:
        raise UserError(f"space.{key}: give exactly one of {', '.join(DIMENSIONS)} (got {sorted(dim)})")
    kind, arg = next(iter(dim.items()))
    if not isinstance(arg, list) or not arg:
        raise UserError(f"space.{key}.{kind}: needs a non-empty list")
    if kind in ("choice", "grid"):
        return arg
    if len(arg) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in arg) or arg[0] >= arg[1]:
        raise UserError(f"space.{key}.{kind}: needs [low, high] numbers with low < high (got {arg})")
    if kind == "loguniform" and arg[0] <= 0:
        raise UserError(f"space.{key}.loguniform: bounds must be > 0 (got {arg})")
    if kind == "randint":
        if not all(isinstance(v, int) for v in arg):
            raise UserError(f"space.{key}.randint: bounds must be integers (got {arg})")
        return [arg[0], arg[1] - 1]  # high is exclusive
    return [float(arg[0]), float(arg[1])]


def check(spec: SweepSpec) -> None:
    """Everything that would make a trial fail for a reason known now."""
    for where, ov in (("overrides", spec.overrides), ("trial_overrides", spec.trial_overrides)):
        for key in ov:
            try:
                tcfg.check_key(key)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
    base = base_config(spec)
    probe = trial_config(spec, {})
    if probe.scaling.elastic:
        # Trials are packed on the cluster by their size, and a throughput sweep compares trials at one size.
        raise UserError(f"a sweep's trials run at one size: set scaling.num_workers to one number (the trials' config "
                        f"has the range {probe.scaling.num_workers})")
    m = spec.search.method
    if m == "microbatch":
        if spec.space:
            raise UserError("search.method=microbatch searches batch.micro_batch_size itself; remove `space` "
                            f"(it names {', '.join(spec.space)})")
        if not microbatch_grid(spec):
            raise UserError(f"no power-of-two micro-batch in [{spec.microbatch.min}, {spec.microbatch.max}] divides "
                            f"the per-worker batch {base.global_batch // base.scaling.num_workers}; "
                            f"change microbatch.min/max or the global batch")
    elif not spec.space:
        raise UserError(f"search.method={m} needs a `space` (e.g. optim.lr: {{loguniform: [1.0e-4, 1.0e-2]}})")
    for key, dim in spec.space.items():
        try:
            tcfg.check_key(key)
        except UserError as e:
            raise UserError(f"space: {e}") from None
        values = _dimension_values(key, dim)
        if m == "grid" and next(iter(dim)) != "grid":
            raise UserError(f"search.method=grid needs every dimension as {{grid: [...]}}; space.{key} is "
                            f"{next(iter(dim))}")
        for v in values:
            try:
                trial_config(spec, {key: v})
            except UserError as e:
                raise UserError(f"space.{key} value {v!r}: {e}") from None
    if spec.objective.metric.startswith("val_") and not probe.data.val:
        raise UserError(f"objective.metric={spec.objective.metric} needs validation data: set data.val")
    if spec.scheduler.type == "asha":
        if not probe.run.eval_every or probe.run.eval_every > spec.scheduler.grace_period:
            raise UserError(f"scheduler asha compares trials at step {spec.scheduler.grace_period} and later, but "
                            f"trials evaluate every {probe.run.eval_every} steps (run.eval_every); set "
                            f"run.eval_every <= scheduler.grace_period (in trial_overrides)")
        if spec.scheduler.grace_period >= probe.run.max_steps:
            raise UserError(f"scheduler.grace_period={spec.scheduler.grace_period} must be below the trial budget "
                            f"of {probe.run.max_steps} steps (budget.max_steps)")
