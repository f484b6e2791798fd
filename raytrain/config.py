"""The typed config tree: YAML recipes in, dotted overrides on top, validated once, saved with every run.

The same dotted keys (`optim.lr`, `batch.micro_batch_size`) are used on the command line, in Tune
search spaces and in saved checkpoints, so there is exactly one vocabulary for a run's settings.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raytrain import storage
from raytrain.errors import UserError

RECIPES_DIR = Path(__file__).parent / "recipes"
# What `raytrain train` and `raytrain config` take without --config: the laptop recipe, said on their first line.
DEFAULT_RECIPE = "tiny"


def no_recipe_line() -> str:
    return (f"no --config given: the laptop recipe `{DEFAULT_RECIPE}` (raytrain/recipes/{DEFAULT_RECIPE}.yaml: a tiny "
            "model, runs in ./runs); name a recipe or a YAML file with --config")


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `3e-4` as a float (YAML 1.2 rules); PyYAML's 1.1 rules want `3.0e-4`."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """YAML text -> Python values, with YAML 1.2 floats."""
    return yaml.load(text, Loader=YamlLoader)


class Section(BaseModel):
    """A group of config keys: strict types, unknown keys refused."""

    # strict: "4" is not an int and 1.5 is not an int; unknown keys are errors, not silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class LoraSection(Section):
    """LoRA adapters through `peft` (`pip install raytrain[lora]`): the base model is frozen, only the adapters train
    and are checkpointed (raytrain/lora.py)."""

    r: int = Field(0, ge=0, description="adapter rank; 0: no LoRA (every parameter trains)")
    alpha: float = Field(16.0, gt=0.0, description="scaling numerator: the update is (alpha / r) x B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] = Field(default_factory=list, description="module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; empty: peft's default for the family (gpt2: c_attn; llama / mixtral: q_proj, v_proj)")


class ModelConfig(Section):
    """Transformer shape. Built with `transformers` config classes, random init, no hub access."""

    family: Literal["gpt2", "llama", "mixtral"] = Field("gpt2", description="architecture: GPT-2 (learned positions), Llama (RoPE, RMSNorm, SwiGLU) or Mixtral (Llama with a Mixture-of-Experts MLP)")
    n_layer: int = Field(2, ge=1, description="transformer blocks")
    hidden_size: int = Field(128, ge=8, description="model width; divisible by n_head")
    n_head: int = Field(4, ge=1, description="attention heads")
    n_kv_head: Optional[int] = Field(None, ge=1, description="llama only: key/value heads (grouped-query attention); null: n_head")
    intermediate_size: Optional[int] = Field(None, ge=1, description="MLP width; null: 4x hidden (gpt2) or ~8/3x rounded to 256 (llama)")
    seq_len: int = Field(128, ge=2, description="context length in tokens; must equal the dataset's packing length")
    vocab_size: Optional[int] = Field(None, ge=2, description="null: taken from the dataset's tokenizer")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout everywhere; 0 for pre-training")
    tie_embeddings: bool = Field(True, description="share input embedding and output projection")
    init_std: float = Field(0.02, gt=0.0, description="std of the normal weight init")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="torch SDPA (flash / memory-efficient kernels where available) or eager")
    activation_checkpointing: bool = Field(False, description="recompute activations in backward: less memory, ~30% more compute")
    compile: Union[bool, Literal["auto"]] = Field("auto", description="torch.compile (inductor), block by block so the identical blocks compile once (ZeRO-3: DeepSpeed's engine.compile of the whole model): the first steps wait for compilation (tens of seconds), later ones are faster on GPU. auto: on for GPU workers, off on CPU (where compiling costs more than it gives at small sizes) and with LoRA")
    loss: Literal["auto", "chunked", "full"] = Field("auto", description="training and validation loss kernel. chunked: cross entropy fused with the output projection, chunk by chunk, so the micro-batch's [tokens, vocab] fp32 logits never exist (ZeRO 0-2, no tensor parallelism, no LoRA); full: logits, then cross entropy. auto: chunked where it applies")
    moe_experts: int = Field(8, ge=2, description="mixtral only: experts per MoE layer")
    moe_top_k: int = Field(2, ge=1, description="mixtral only: experts each token is routed to (top-k routing; dropless, so there is no capacity factor)")
    moe_aux_loss_coef: float = Field(0.01, ge=0.0, description="mixtral only: weight of the router's load-balancing loss added to the training loss (logged as aux_loss)")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters (model.lora.r > 0)")
    init_from: Optional[str] = Field(None, description="fine-tune: start from this Hugging Face model directory (local or s3://, e.g. a `raytrain export`); its config sets the model shape, and the data must use its tokenizer")

    @field_validator("compile", mode="before")
    @classmethod
    def _bool_or_auto(cls, v: Any) -> Any:
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError("must be true, false or 'auto'")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.n_head:
            raise ValueError(f"model.hidden_size={self.hidden_size} must be divisible by model.n_head={self.n_head}")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head={self.n_head} must be divisible by model.n_kv_head={self.n_kv_head}")
        if self.moe_top_k > self.moe_experts:
            raise ValueError(f"model.moe_top_k={self.moe_top_k} must be <= model.moe_experts={self.moe_experts}")
        return self


class DataSource(Section):
    """One source of a data mixture: a prepared train split and its share of every global batch."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="the source's name in metrics (val_loss/<name>, tokens_seen/<name>) and in data.mixture_schedule")
    path: str = Field(..., min_length=1, description="URI of the source's prepared train split (dir with manifest.json); every source must share one tokenizer")
    weight: float = Field(1.0, description="relative share of each global batch from step 0 (normalised over the sources; 0: unused until a schedule stage raises it)")
    val: Optional[str] = Field(None, description="URI of the source's prepared validation split: evaluated as val_loss/<name>, val_ppl/<name>; null: none")


class MixtureStage(Section):
    """From `start_step` on, these weights (sources not named keep their previous weight)."""

    start_step: int = Field(..., ge=1, description="the stage applies once this many optimizer steps are done (to metrics steps start_step + 1 on; global batch index start_step), as new weights on resume from checkpoint step R apply from step R + 1")
    weights: dict[str, float] = Field(..., description="source name -> relative weight from start_step on")


class DataConfig(Section):
    """Prepared datasets (see `raytrain prepare`): each URI is a split directory holding manifest.json."""

    train: Union[str, list[DataSource], None] = Field(None, description="URI of the prepared train split (local path or s3://...; dir with manifest.json), or a mixture: a list of sources {name, path, weight, val} (docs/DATA.md)")
    # A mixture's weights may change during the run (e.g. more curated text for the last 10 % of steps).
    mixture_schedule: list[MixtureStage] = Field(default_factory=list, description="mixture only: stages {start_step, weights} in increasing start_step")
    val: Optional[str] = Field(None, description="URI of the prepared validation split; null: no validation")
    format: Literal["parquet", "webdataset"] = Field("parquet", description="shard format to train from (the dataset must have been prepared with it); both give the same sample order")
    shuffle: bool = Field(True, description="shuffle shard order and rows each epoch (deterministic from run.seed)")
    pin_memory: bool = Field(True, description="GPU only: batches go to the device through pinned host memory with non-blocking copies (ignored on CPU, where batches are used in place)")
    eval_samples: int = Field(512, ge=1, description="validation sequences per evaluation (the first ones of val)")
    verify: Literal["size", "checksum"] = Field("size", description="check of every shard against the manifest before training: sizes (cheap) or sha256 (reads all data once)")
    stall_timeout_s: float = Field(600.0, gt=0.0, description="fail with a diagnosis when no data arrives for this long (never hang)")
    document_mask: bool = Field(True, description="fine-tuning data (prepare format=prompt_completion|chat): positions restart at every packed example and attention stays inside it, so an example is learned as if alone in its sequence; false: packed examples see each other (the loss mask holds either way). Text data has no example boundaries and ignores it")
    reader: Literal["auto", "direct", "ray"] = Field("auto", description="how training workers get their rows: direct (each rank reads the units its lanes need from storage, pyarrow) or ray (one Ray Data pipeline per worker-group start reads and decodes the units the sample plan names, on the cluster's CPUs, and hands each to the ranks that need it by key: the same batches; docs/DATA.md). auto: ray where the cluster has CPU-only data nodes (the custom `data` resource of cluster/*.yaml), else direct (on a machine whose CPUs also train, the pipeline's tasks compete with the workers; docs/BENCHMARKS.md)")
    transform: Optional[str] = Field(None, description="a function run on every unit's rows as they are read, module:function (or a built-in: fim, fill-in-the-middle), seeded by (run seed, epoch, unit): the same rows after a resume or resize, with either reader (data.reader=ray runs it on the pipeline's CPU nodes); checked on the split's first unit before training starts (docs/DATA.md)")
    transform_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of data.transform, e.g. {rate: 0.5, spm_rate: 0.5} for fim")
    ingest_queue_units: int = Field(4, ge=1, description="data.reader=ray: units waiting for a rank before the pipeline is held back (per rank, in the object store and in the rank)")
    ingest_resources: Optional[dict[str, float]] = Field(None, description="data.reader=ray: Ray resources each read task asks for besides 1 CPU; null: {data: 0.001} when some node offers the custom `data` resource (the CPU-only data nodes of cluster/*.yaml), so the tasks never take a GPU host's cores, else none (a laptop: its own CPUs); {}: anywhere")
    on_bad_shard: Literal["error", "skip"] = Field("error", description="a shard that cannot be read during training (corrupt Parquet, truncated tar): stop with an error naming it, or skip it and count it (metrics: data_skipped_shards)")


class BatchConfig(Section):
    """Global batch = micro_batch_size x gradient_accumulation_steps x num_workers (sequences)."""

    micro_batch_size: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(8, description="sequences per worker per forward/backward. auto: the largest that divides the global batch's share per worker and whose estimated memory fits the worker (memory_cap_mb, else 90 % of the GPU's memory, on CPU the host's memory over the workers); needs global_batch_size, from which accumulation follows")
    gradient_accumulation_steps: Optional[int] = Field(1, ge=1, description="micro-batches per optimizer step; null: derived from global_batch_size")
    global_batch_size: Optional[int] = Field(None, ge=1, description="sequences per optimizer step; if set, checked against (or used to derive) accumulation")
    memory_cap_mb: Optional[float] = Field(None, gt=0, description="micro_batch_size=auto: the memory (MiB) a worker's model states and activations may take, by raytrain's estimate (sweep/memory_estimate.py); null: 90 % of the GPU's memory (CPU workers: the host's memory over the workers)")

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _size_or_auto(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("must be a whole number of sequences >= 1 or 'auto'")


class OptimConfig(Section):
    """AdamW and its schedule (linear warmup, then cosine / linear decay to min_lr_ratio * lr)."""

    lr: float = Field(3e-4, gt=0.0, description="peak learning rate")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2, description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    weight_decay: float = Field(0.1, ge=0.0, description="decoupled weight decay (not applied to biases and norms)")
    warmup_steps: int = Field(100, ge=0, description="linear warmup from lr/warmup_steps to lr")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warmup, over the rest of run.max_steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr as a fraction of lr")
    grad_clip: float = Field(1.0, ge=0.0, description="global gradient-norm clip; 0 disables")
    fused: Literal["torch", "deepspeed", "none"] = Field("torch", description="torch's fused AdamW kernel (GPU and CPU), DeepSpeed's FusedAdam (GPU: a CUDA op JIT-built on first use; CPU: torch's fused AdamW) or torch's multi-tensor AdamW (none)")


class PrecisionConfig(Section):
    """Mixed precision. auto: bf16 on a GPU that has it, fp16 on older GPUs, fp32 on CPU."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="training precision")
    initial_scale_power: int = Field(16, ge=0, description="fp16: dynamic loss scale starts at 2**this")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: steps without overflow before the scale grows")


class DeepSpeedSection(Section):
    """ZeRO settings; `extra` is deep-merged into the generated DeepSpeed JSON as an escape hatch."""

    zero_stage: int = Field(2, ge=0, le=3, description="0: plain data parallel; 1: shard optimizer; 2: + gradients; 3: + parameters")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field("none", description="optimizer state offload (stage >= 1)")
    offload_param: Literal["none", "cpu", "nvme"] = Field("none", description="parameter offload (stage 3)")
    nvme_path: Optional[str] = Field(None, description="local NVMe directory for nvme offload")
    tensor_parallel_size: int = Field(1, ge=1, description="DeepSpeed AutoTP: split each attention / MLP weight over this many workers (llama family, ZeRO stage 1-3); data-parallel size = num_workers / this, and the ranks of one group train on the same micro-batches")
    extra: dict[str, Any] = Field(default_factory=dict, description="any DeepSpeed config keys, merged over the generated ones")

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> "DeepSpeedSection":
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param needs deepspeed.zero_stage=3")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1")
        if "nvme" in (self.offload_param, self.offload_optimizer) and not self.nvme_path:
            raise ValueError("NVMe offload needs deepspeed.nvme_path")
        return self


class ScalingSection(Section):
    """Ray Train workers and the CPUs they need beside the training step."""

    num_workers: Union[int, list[int]] = Field(2, description="Ray Train workers (data-parallel ranks): a number, or [MIN, MAX] for an elastic run that trains on the capacity there is, at any size in the range that keeps batch.global_batch_size (required with a range; micro-batch and accumulation then follow from the size, batch.gradient_accumulation_steps is not used)")
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL; false: CPU and gloo")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="logical CPUs per worker (also torch threads)")
    gpus_per_worker: float = Field(1.0, ge=0.0, description="GPUs per worker when use_gpu")
    resources_per_worker: dict[str, float] = Field(default_factory=dict, description="extra custom Ray resources per worker, e.g. {spot: 1}")
    data_cpus: float = Field(1.0, gt=0.0, description="logical CPUs reserved beside the workers' for work outside the step (each worker's data reader threads, checkpoint uploads); counted when sizing a local Ray instance, checking a cluster and packing Tune trials")
    collective_timeout_s: int = Field(1800, ge=1, description="a collective (gradient all-reduce, barrier) waiting longer than this fails with a diagnosis naming the rank and the collective instead of hanging; a warning is logged at half of it")
    address: Optional[str] = Field(None, description="Ray cluster address; null: RAY_ADDRESS if set, else a new local Ray instance")
    resize_monitor_s: float = Field(30.0, gt=0, description="elastic runs: how often a running group looks for capacity to grow into")
    grow_stable_s: Optional[float] = Field(None, ge=0, description="elastic runs: a node counts toward growing only once it has been alive this long, so a node that comes and goes costs at most one restart; null: resize_monitor_s")
    resize_wait_s: float = Field(60.0, ge=0, description="elastic runs: before growing, the controller asks the ranks for a checkpoint at their next step and waits this long for it (a step, a checkpoint's save and commit); without it in time the group grows from the newest checkpoint")

    @field_validator("num_workers", mode="before")
    @classmethod
    def _size_or_range(cls, v: Any) -> Any:
        # One plain message instead of one error per branch of the union.
        whole = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
        if whole(v) and v >= 1:
            return v
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(whole(x) for x in v):
            lo, hi = v
            if lo < 1:
                raise ValueError(f"[MIN, MAX] = {list(v)}: MIN must be >= 1")
            if lo > hi:
                raise ValueError(f"[MIN, MAX] = {list(v)}: MIN is larger than MAX")
            return list(v)
        raise ValueError("must be a whole number of workers >= 1 or a range [MIN, MAX]")

    @property
    def elastic(self) -> bool:
        """Whether the run's size is a range (raytrain/elastic.py follows the capacity inside it)."""
        return isinstance(self.num_workers, list) and self.num_workers[0] != self.num_workers[1]

    @property
    def worker_resources(self) -> dict[str, float]:
        """The Ray resources one training worker takes."""
        return {"CPU": self.cpus_per_worker, **self.resources_per_worker,
                **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, list) else self.num_workers



class CheckpointSection(Section):
    """Where the run lives (`<storage>/<run.name>/`) and how often its state is saved."""

    storage: str = Field("~/raytrain_runs", description="run storage: local path or s3://bucket/prefix (AWS_ENDPOINT_URL for other S3 stores)")
    every_n_steps: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(1000, description="checkpoint interval in optimizer steps; auto: the Young-Daly interval sqrt(2 x checkpoint cost x mtbf_s), from the measured cost and the interruptions seen")
    mtbf_s: float = Field(7200.0, gt=0, description="expected seconds between interruptions (spot reclaims, failures) before any is seen; every_n_steps=auto, memory_every_n_steps=auto and `raytrain cost` use it. Example figure, set it from your provider's interruption rate")
    auto_initial_cost_s: float = Field(2.0, gt=0, description="every_n_steps=auto: checkpoint cost assumed until the first checkpoint is measured")

    @field_validator("every_n_steps", "memory_every_n_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> Any:
        # One plain message instead of one error per branch of the union.
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("must be a whole number of steps >= 1 or 'auto'")
    keep_last: int = Field(3, ge=1, description="the newest complete checkpoints kept")
    keep_every: int = Field(0, ge=0, description="also keep every checkpoint whose step is a multiple of this; 0: none")
    save_final: bool = Field(True, description="checkpoint at run.max_steps")
    upload: Literal["async", "sync"] = Field("async", description="async: training goes on while the checkpoint uploads (its stall is the local write); sync: training waits for the upload and commit")
    on_upload_failure: Literal["warn", "stop"] = Field("warn", description="an upload that still fails after retries leaves that checkpoint uncommitted; warn and train on, or stop the run")
    upload_retries: int = Field(3, ge=0, description="retries (with backoff) of a failed checkpoint upload, on top of the S3 client's own retries")
    commit_timeout_s: float = Field(600.0, gt=0, description="rank 0 waits this long for every rank's upload before giving up on a checkpoint")
    local_dir: Optional[str] = Field(None, description="node-local directory for restore downloads (each node fetches only its ranks' files, once, into restore/) and the copy a save writes before upload (staging/); what killed processes left there is removed at start. Default: the node's largest local disk (/opt/dlami/nvme, /mnt, ...; else ~/.cache)/raytrain")
    verify_on_resume: Literal["checksum", "size"] = Field("checksum", description="how the checkpoint to resume from is checked: sha256 of every file (reads it once more) or sizes only")
    on_preemption: bool = Field(True, description="checkpoint at once when a node is drained for preemption or a worker gets SIGTERM")
    watch_notices: bool = Field(True, description="where a node's own notice watcher (the VM configs start one) does not run, the run's local rank 0 on each node reads the cloud's reclaim and maintenance notices from the instance metadata and drains its node in time (only on a machine whose firmware names AWS, GCP or Azure, or with RAYTRAIN_METADATA_URL set)")
    memory: bool = Field(True, description="host-memory snapshots (docs/FAULT_TOLERANCE.md): each rank copies its state into shared memory held by a per-node actor of the run, so a restarted worker group resumes from the newest snapshot instead of the last storage checkpoint; false: storage checkpoints only")
    memory_every_n_steps: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field("auto", description="memory snapshot interval in optimizer steps (also at every storage checkpoint); a restart redoes at most this many steps. auto: every other step over an attempt's first 8 steps, which measures a snapshot's cost, then the Young-Daly interval (interval x step time = sqrt(2 x cost x MTBF), MTBF checkpoint.mtbf_s over the run's attempts so far: the least expected loss), never costing more than memory_cost_target (one interval for all ranks, logged)")
    memory_cost_target: float = Field(0.008, gt=0.0, lt=1.0, description="memory_every_n_steps=auto: the most of the training time the snapshots may cost, whatever Young-Daly asks (their stalls and what their copies take from the steps after them); 0.8 %, so that the loop's own work with them stays under 1 % of a step")

    memory_budget_gb: float = Field(0.0, ge=0, description="most GiB of snapshots per node (two generations per rank, 12 x params / data-parallel ranks bytes each); over it: one warning and storage-only recovery. 0: only the free space of memory_dir limits it")
    memory_peer_every_n_steps: int = Field(1, ge=0, description="copy each rank's newest snapshot to the next node's actor every this many steps, so the loss of one node restores from memory:peer; a copy still in flight skips the next ones (the rate limit). Bytes per node per copy: 12 x params / nodes. 0: no peer copy")
    memory_fetch_timeout_s: float = Field(60.0, gt=0, description="a restore waits this long for another node's actor to send a rank's snapshot")
    memory_dir: str = Field("/dev/shm", description="shared-memory directory (tmpfs) for the snapshots on every node")


class RunSection(Section):
    """Identity and length of a run. The same name and storage resume the run."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="run name: its directory under checkpoint.storage")
    max_steps: int = Field(100, ge=1, description="optimizer steps to train")
    seed: int = Field(0, ge=0, lt=2**32, description="seed for init, data order and RNGs")
    eval_every: int = Field(100, ge=0, description="validation interval in steps; 0: only at the end (and step 0)")
    log_every: int = Field(10, ge=1, description="metrics interval in steps (metrics.jsonl, Prometheus, TensorBoard)")
    progress_every: Optional[int] = Field(None, ge=1, description="console progress-line interval in steps, rounded up to a multiple of log_every; null: about 10 lines per run. Validation steps and the last step always print")
    max_failures: int = Field(3, ge=0, description="worker-failure restarts before the run fails")
    max_preemptions: int = Field(-1, ge=-1, description="restarts after node preemptions (a worker lost with its node, or drained), counted apart from failures; -1: unlimited")
    max_wait_for_capacity: Optional[float] = Field(None, gt=0, description="elastic runs: seconds the run may wait below scaling.num_workers' MIN for nodes to return before it ends (exit status 3); null: no limit")


MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")


class WandbSection(Section):
    """Weights & Biases: rank 0 logs every record into one W&B run per training run. Credentials: `wandb login` / WANDB_API_KEY, never the config."""

    project: Optional[str] = Field(None, min_length=1, description="W&B project; null: no W&B")
    entity: Optional[str] = Field(None, description="W&B entity (user or team); null: the account's default")
    mode: Literal["online", "offline"] = Field("online", description="online: to the W&B server; offline: files under WANDB_DIR, for `wandb sync` later")
    tags: list[str] = Field(default_factory=list, description="tags of the W&B run")
    group: Optional[str] = Field(None, description="W&B run group (e.g. the sweep or experiment family)")
    dir: Optional[str] = Field(None, description="local directory for W&B's files on rank 0's node (offline runs live there); null: WANDB_DIR or the working directory")


class MlflowSection(Section):
    """MLflow: rank 0 logs every record into one MLflow run per training run. Credentials: MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN, never the URI."""

    tracking_uri: Optional[str] = Field(None, description="MLflow tracking URI (http://host:port, file:, sqlite:, ...); null: no MLflow")
    experiment: str = Field("raytrain", min_length=1, description="MLflow experiment the run is logged under (created when missing)")

    @field_validator("tracking_uri")
    def _well_formed(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        from urllib.parse import urlsplit

        u = urlsplit(v)
        try:
            port_ok = u.port is None or u.port > 0
        except ValueError:  # not a number, or past 65535
            port_ok = False
        if u.scheme and len(u.scheme) > 1 and u.scheme not in MLFLOW_SCHEMES:  # one letter: a Windows drive
            raise ValueError(f"not an MLflow tracking URI: use one of {', '.join(MLFLOW_SCHEMES)} (e.g. http://127.0.0.1:5000)")
        if u.scheme in ("http", "https") and (not u.hostname or not port_ok):
            raise ValueError("an http(s) tracking URI needs a host and a valid port, e.g. http://127.0.0.1:5000")
        if u.username or u.password:
            raise ValueError("credentials do not belong in the URI (it is saved with the config): set "
                             "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD instead")
        return v


class MetricsSection(Section):
    """Where each log step's metrics go besides metrics.jsonl (see docs/OBSERVABILITY.md), and the peak used for MFU."""

    prometheus: bool = Field(True, description="export raytrain_* series through Ray's metrics API (Ray's Prometheus endpoint, labels run/worker)")
    goodput_every_s: float = Field(60.0, ge=0.0, description="with prometheus: how often the driver recomputes the goodput ledger while the run lives (raytrain_goodput_ratio, raytrain_badput_seconds by kind; reading only what the run directory gained since); 0: off")
    tensorboard: bool = Field(False, description="also write TensorBoard event files to <run>/tensorboard/")
    peak_tflops: Optional[float] = Field(None, gt=0.0, description="peak TFLOP/s of one worker's device (GPU or CPU) for MFU; null: the GPU table in worker/telemetry.py, or on CPU measured at start-up by a short fp32 matmul probe on the worker's threads, cached per machine in ~/.cache/raytrain/cpu_peak.json")
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases tracker (`pip install raytrain[wandb]`)")
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description="MLflow tracker (`pip install raytrain[mlflow]`)")
    on_tracker_failure: Literal["warn", "stop"] = Field("warn", description="a tracker unreachable at start or failing mid-run: one warning line and training goes on (metrics.jsonl stays complete), or stop the run")
    tracker_timeout_s: float = Field(30.0, gt=0.0, description="the longest the end of an attempt waits for a tracker to send what it still holds")


class EvalSection(Section):
    """Downstream evaluation with EleutherAI's lm-evaluation-harness (`pip install raytrain[eval]`): `raytrain eval --tasks`, and committed checkpoints during training, each on a Ray task of its own."""

    tasks: list[str] = Field(default_factory=list, description="harness task names evaluated on committed checkpoints during training; empty: none")
    every_n_checkpoints: int = Field(1, ge=1, description="evaluate every n-th checkpoint an attempt commits (the final one always)")
    limit: Optional[int] = Field(None, ge=1, description="documents per task (the harness's --limit); null: all")
    num_fewshot: Optional[int] = Field(None, ge=0, description="few-shot examples (the harness's --num_fewshot); null: each task's default")
    include_path: Optional[str] = Field(None, description="a directory of your own task YAMLs (the harness's --include_path), readable on every node; relative paths are resolved at submit")
    batch_size: int = Field(1, ge=1, description="the harness's --batch_size (1, its default, gives its CLI's numbers exactly)")
    clean_subset: Optional[str] = Field(None, description="a --clean-out file of `raytrain data contamination` ({task: indexes of its clean examples}): each task listed there is also scored on those examples only, reported as <task>/clean beside the whole")
    resources: Optional[dict[str, float]] = Field(None, description="Ray resources of each evaluation task, e.g. {CPU: 4, GPU: 1}; null: 1 CPU, and 1 GPU where the cluster has GPUs, so it never shares a training worker's device")
    wait_at_end_s: float = Field(600.0, ge=0.0, description="the end of training waits this long for evaluations still running, to log their results; later ones are logged by the next resume")

    @field_validator("include_path")
    def _absolute(cls, v: Optional[str]) -> Optional[str]:
        return os.path.abspath(os.path.expanduser(v)) if v else v


class HealthSection(Section):
    """Health rules checked in the training loop (throughput, loss, gradient norm, memory). Null thresholds: GPU defaults on GPU, CPU defaults on CPU."""

    enabled: bool = Field(True, description="evaluate the rules; each violation is logged once with advice and counted")
    min_tflops_per_worker: Optional[float] = Field(None, ge=0.0, description="throughput alert below this achieved TFLOP/s per worker; null: 0.8 (GPU) / 1e-4 (CPU)")
    grad_norm_max: Optional[float] = Field(None, gt=0.0, description="gradient-norm alert above this; null: 1.0 (GPU) / 10 (CPU: tiny models at high lr)")
    grad_norm_min: float = Field(1e-5, ge=0.0, description="gradient-norm alert below this (vanishing gradients)")
    memory_frac_max: float = Field(0.95, gt=0.0, le=1.0, description="memory alert at this fraction of the accelerator's (CPU: the host's) memory ...")
    memory_minutes: float = Field(5.0, ge=0.0, description="... held for this many minutes")
    eval_patience: int = Field(3, ge=1, description="convergence alert when validation loss has not improved for this many consecutive evaluations")
    spike_zscore: float = Field(6.0, ge=0.0, description="a step loss this many standard deviations above the recent window is a spike; 0: off")
    spike_window: int = Field(50, ge=5, description="recent step losses the spike z-score is measured against")
    grace_steps: int = Field(10, ge=0, description="steps after a (re)start or rollback before the throughput, gradient-norm and spike rules apply")
    on_bad_loss: Literal["rollback", "stop", "warn"] = Field("rollback", description="NaN/inf loss or spike: roll back to the last complete checkpoint and skip the data window, stop, or only warn")
    skip_batches: int = Field(1, ge=1, description="global batches skipped on a rollback, starting with the offending one")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks allowed in one run; one more stops it with a health report")


class CostSection(Section):
    """Prices for `raytrain cost` (USD per node-hour). Defaults are EXAMPLES: AWS us-west-2 list prices as of 2024
    (g5.xlarge on-demand 1.006, a typical g5.xlarge spot price, m5.2xlarge head); set your own."""

    spot_per_hour: float = Field(0.45, ge=0.0, description="a spot worker node (example: g5.xlarge spot, us-west-2, 2024)")
    on_demand_per_hour: float = Field(1.006, ge=0.0, description="an on-demand worker node, and the comparison price for spot time (example: g5.xlarge, 2024)")
    head_per_hour: float = Field(0.384, ge=0.0, description="the head node, always on-demand (example: m5.2xlarge, 2024)")
    record_nodes: bool = Field(True, description="the driver polls Ray's node list during the run and writes <run>/nodes.json (node time by market, lost nodes)")


# Keys that no longer do anything, and why. Saved configs and recipes that hold them still load (they are
# dropped, with a warning where a person wrote them); a new override or search-space key naming one fails.
RETIRED = {
    "data.shuffle_window": "training shuffles rows inside each unit of the sample plan (docs/DATA.md)",
    "data.prefetch_batches": "the training reader reads ahead by itself, about one unit per lane",
    "checkpoint.preemption_check_s": "the preemption notice is read every step and agreed on through the step's "
                                     "loss all-reduce",
    # Merged pairs: one key per setting. The message names the key that holds it now.
    "metrics.cpu_peak_tflops": "set metrics.peak_tflops instead (one worker's device peak, CPU workers included)",
    "checkpoint.staging_dir": "set checkpoint.local_dir instead (a save's staging is <checkpoint.local_dir>/staging)",
}


def _retired_in(tree: Any) -> list[str]:
    if not isinstance(tree, dict):
        return []
    return [k for k in RETIRED if isinstance(tree.get(k.split(".")[0]), dict) and k.split(".")[1] in tree[k.split(".")[0]]]


class StorageSection(Section):
    sse: Literal["", "AES256", "aws:kms"] = Field("", description="server-side encryption raytrain asks for on every S3 object it writes itself (AES256: SSE-S3, aws:kms: SSE-KMS); sets RAYTRAIN_S3_SSE for the run's processes. Ray Train's own files rely on the bucket's default encryption (docs/CLUSTERS.md)")
    kms_key_id: Optional[str] = Field(None, description="sse=aws:kms: the KMS key (default: the account's aws/s3 key); sets RAYTRAIN_S3_SSE_KMS_KEY_ID")
    allow_http: bool = Field(False, description="accept a plain http:// S3 endpoint outside 127.0.0.0/8 (object traffic unencrypted); sets RAYTRAIN_S3_ALLOW_HTTP")

    def apply(self) -> None:
        """Into this process's environment, which every Ray process of the run inherits (raytrain/ray_connect.py)."""
        from raytrain import storage

        for var, value in ((storage.SSE, self.sse), (storage.SSE_KMS_KEY_ID, self.kms_key_id or ""),
                           (storage.ALLOW_HTTP, "1" if self.allow_http else "")):
            if value:
                os.environ[var] = value


def takes_chunked_loss(loss: str, *, zero_stage: int, tensor_parallel: int = 1, lora: bool = False) -> bool:
    """Whether training takes the chunked loss (model.loss; auto: ZeRO 0-2, no tensor parallelism, no LoRA), which
    never holds a micro-batch's whole [tokens, vocab] logits."""
    if loss != "auto":
        return loss == "chunked"
    return zero_stage < 3 and tensor_parallel == 1 and not lora


class Config(Section):
    """A whole run. `raytrain config --config NAME` prints it resolved."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    run: RunSection = Field(default_factory=RunSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    health: HealthSection = Field(default_factory=HealthSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    cost: CostSection = Field(default_factory=CostSection)
    storage: StorageSection = Field(default_factory=StorageSection)

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, tree: Any) -> Any:
        found = _retired_in(tree)
        if found:
            tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
            for key in found:
                section, name = key.split(".")
                tree[section].pop(name)
        return tree

    @model_validator(mode="after")
    def _mixture_consistent(self) -> "Config":
        from raytrain.data.mixture import check_mixture

        check_mixture(self.data.train, self.data.mixture_schedule)  # weights, names, stage order
        if isinstance(self.data.train, list) and self.data.transform:
            raise ValueError("data.transform does not take a mixture yet (data.train is a list of sources)")
        if isinstance(self.data.train, list) and self.data.reader == "ray":
            raise ValueError("data.reader=ray does not take a mixture yet (data.train is a list of sources); use "
                             "data.reader=direct")
        return self

    @model_validator(mode="after")
    def _one_gpu_per_worker(self) -> "Config":
        # DeepSpeed puts each rank on cuda:LOCAL_RANK, which is only the GPU Ray gave it when every worker
        # has exactly one; NCCL also refuses two ranks on one GPU. (Here, not in the section: a section's
        # messages are shown lower-cased with the whole section after them.)
        s = self.scaling
        if s.use_gpu and s.gpus_per_worker != 1:
            raise ValueError(f"scaling.gpus_per_worker={s.gpus_per_worker:g}: DeepSpeed runs one process per GPU; "
                             "set it to 1 and scale with scaling.num_workers (or deepspeed.tensor_parallel_size)")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> "Config":
        tp, m = self.deepspeed.tensor_parallel_size, self.model
        if tp == 1:
            return self
        key = f"deepspeed.tensor_parallel_size={tp}"
        s = self.scaling
        if not s.elastic and s.max_workers % tp:
            raise ValueError(f"{key} must divide scaling.num_workers={s.max_workers}")
        if s.elastic and not any(n % tp == 0 for n in range(s.min_workers, s.max_workers + 1)):
            # An elastic run changes size in whole tensor-parallel groups.
            raise ValueError(f"{key} divides no size in scaling.num_workers={s.num_workers}; widen the range to "
                             f"include a multiple of {tp}")
        if m.family != "llama":
            # gpt2: "AutoTP not supported for model" (deepspeed/module_inject/auto_tp.py, Conv1D layers);
            # mixtral: its tp_plan styles 'moe_tp_experts' / 'packed_colwise' are rejected (tp_plan_converter.py).
            raise ValueError(f"{key} needs model.family=llama: DeepSpeed 0.19's AutoTP cannot shard {m.family} models")
        for name, n in (("model.n_head", m.n_head), ("model.n_kv_head", m.n_kv_head or m.n_head),
                        ("model.intermediate_size", m.intermediate_size or 256)):
            if n % tp:
                raise ValueError(f"{key} must divide {name}={n} (each rank holds an equal slice)")
        if self.deepspeed.zero_stage == 0:
            # Resume across sizes and export merge the rank slices through DeepSpeed's universal checkpoint,
            # which is built from ZeRO optimizer partitions.
            raise ValueError(f"{key} needs deepspeed.zero_stage >= 1 (1-3 work with AutoTP)")
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> "Config":
        """The settings LoRA adapters (raytrain/lora.py) cannot run under."""
        if self.model.lora.r <= 0:
            return self
        if self.deepspeed.zero_stage == 3:
            # Under ZeRO-3 the model is built inside zero.Init, partitioned before peft could wrap it, and the
            # checkpoint / export paths consolidate whole modules; adapters over partitioned weights are not
            # wired. The frozen base is what ZeRO-3 would shard, so offload (ZeRO-2 + offload_optimizer) is the
            # nearest setting that runs.
            raise ValueError("model.lora with deepspeed.zero_stage=3 is not supported (the base is partitioned by "
                             "zero.Init before peft can wrap it); use deepspeed.zero_stage 0-2")
        if self.deepspeed.tensor_parallel_size > 1:
            raise ValueError("model.lora with deepspeed.tensor_parallel_size > 1 is not supported (AutoTP slices the "
                             "layers peft wraps); use 1")
        if self.model.compile is True:
            raise ValueError("model.lora with model.compile=true is not supported; set model.compile=false or auto")
        if self.model.loss == "chunked":
            raise ValueError("model.lora with model.loss=chunked is not supported; set model.loss=full or auto")
        return self

    @model_validator(mode="after")
    def _chunked_loss_fits(self) -> "Config":
        """The chunked loss reads the output projection's weight itself: whole, on this rank."""
        if self.model.loss == "chunked" and self.deepspeed.zero_stage == 3:
            raise ValueError("model.loss=chunked needs deepspeed.zero_stage 0-2 (ZeRO-3 gathers the output "
                             "projection only inside its own forward); set model.loss=full or auto")
        if self.model.loss == "chunked" and self.deepspeed.tensor_parallel_size > 1:
            raise ValueError("model.loss=chunked needs deepspeed.tensor_parallel_size=1; set model.loss=full or auto")
        return self

    @property
    def chunked_loss(self) -> bool:
        """Whether the loss is the chunked one (model.loss, auto resolved)."""
        return takes_chunked_loss(self.model.loss, zero_stage=self.deepspeed.zero_stage,
                                  tensor_parallel=self.deepspeed.tensor_parallel_size, lora=self.model.lora.r > 0)

    @model_validator(mode="after")
    def _batch_consistent(self) -> "Config":
        b, w = self.batch, self.data_parallel_size
        if self.scaling.elastic:
            if b.global_batch_size is None:
                raise ValueError(f"scaling.num_workers={self.scaling.num_workers} (a range) needs "
                                 "batch.global_batch_size: every size trains the same global batch")
            if not self.sizes():
                raise ValueError(f"no size in scaling.num_workers={self.scaling.num_workers} keeps "
                                 f"batch.global_batch_size={b.global_batch_size}: it must divide by the data-parallel "
                                 f"size (workers / deepspeed.tensor_parallel_size); choose a global batch with more "
                                 f"divisors, e.g. {_batch_for(self.scaling.min_workers, self.scaling.max_workers)}")
            return self
        if b.micro_batch_size == "auto":
            if b.global_batch_size is None:
                raise ValueError("batch.micro_batch_size=auto needs batch.global_batch_size (the micro-batch and "
                                 "accumulation are chosen to make it up)")
            if b.global_batch_size % w:
                raise ValueError(f"batch.global_batch_size={b.global_batch_size} is not a multiple of the "
                                 f"data-parallel size {w}")
            return self
        if b.gradient_accumulation_steps is None:
            if b.global_batch_size is None:
                raise ValueError("set batch.gradient_accumulation_steps or batch.global_batch_size")
            per_step = b.micro_batch_size * w
            if b.global_batch_size % per_step:
                raise ValueError(
                    f"batch.global_batch_size={b.global_batch_size} is not a multiple of "
                    f"batch.micro_batch_size x data-parallel size (scaling.num_workers / deepspeed.tensor_parallel_size) = {per_step}"
                )
        elif b.global_batch_size is not None and b.global_batch_size != b.micro_batch_size * b.gradient_accumulation_steps * w:
            raise ValueError(
                f"batch.global_batch_size={b.global_batch_size} != micro_batch_size x gradient_accumulation_steps x "
                f"data-parallel workers = {b.micro_batch_size}x{b.gradient_accumulation_steps}x{w}; set one of them to null"
            )
        return self

    # Derived quantities live here so driver and workers agree on them.
    @property
    def accumulation(self) -> int:
        b = self.batch
        if b.micro_batch_size == "auto":
            raise RuntimeError("batch.micro_batch_size=auto is resolved when training starts (raytrain/micro_batch.py)")
        if self.scaling.elastic:  # at the largest size; a worker group of another size uses at_size(world)
            return self.sizes()[max(self.sizes())][1]
        if b.gradient_accumulation_steps is not None:
            return b.gradient_accumulation_steps
        return b.global_batch_size // (b.micro_batch_size * self.data_parallel_size)

    @property
    def data_parallel_size(self) -> int:
        """Workers that train on different data: the ranks of one tensor-parallel group share their batch (an
        elastic run's: at its largest size; the workers use at_size(world) for the size they have)."""
        return max(1, self.scaling.max_workers // self.deepspeed.tensor_parallel_size)

    def sizes(self) -> dict[int, tuple[Optional[int], Optional[int]]]:
        """The usable world sizes of this run, {workers: (micro_batch, accumulation)}: a size is usable when it
        is a whole number of tensor-parallel groups and the global batch divides by its data-parallel size; its
        micro-batch is the largest one no larger than batch.micro_batch_size that divides a rank's share
        ((None, None) while micro_batch_size is auto). A fixed size: that size alone, as configured."""
        s, tp, b = self.scaling, self.deepspeed.tensor_parallel_size, self.batch
        if not s.elastic:
            mb = None if b.micro_batch_size == "auto" else b.micro_batch_size
            return {s.max_workers: (mb, self.accumulation if mb is not None else None)}
        out: dict[int, tuple[Optional[int], Optional[int]]] = {}
        for n in range(s.min_workers, s.max_workers + 1):
            if n % tp or b.global_batch_size % (n // tp):
                continue
            share = b.global_batch_size // (n // tp)
            if b.micro_batch_size == "auto":
                out[n] = (None, None)
                continue
            mb = max(d for d in range(1, min(share, b.micro_batch_size) + 1) if share % d == 0)
            out[n] = (mb, share // mb)
        return out

    def largest(self) -> "Config":
        """This config at its largest usable size (an elastic run's; a fixed size: unchanged)."""
        return self.at_size(max(self.sizes())) if self.scaling.elastic else self

    def at_size(self, n: int) -> "Config":
        """This config for a worker group of n workers (an elastic run's current size): micro-batch and accumulation
        of that size, the same global batch. The fixed size: unchanged."""
        if not self.scaling.elastic:
            return self
        table = self.sizes()
        if n not in table:
            raise UserError(f"{n} workers is not a usable size of scaling.num_workers={self.scaling.num_workers} "
                            f"(usable: {sorted(table)})")
        mb, acc = table[n]
        if mb is None:
            raise RuntimeError("batch.micro_batch_size=auto is resolved when training starts (raytrain/micro_batch.py)")
        return self.model_copy(update={
            "scaling": self.scaling.model_copy(update={"num_workers": n}),
            "batch": self.batch.model_copy(update={"micro_batch_size": mb, "gradient_accumulation_steps": acc})})

    @property
    def global_batch(self) -> int:
        if self.batch.micro_batch_size == "auto" or self.scaling.elastic:
            return self.batch.global_batch_size
        return self.batch.micro_batch_size * self.accumulation * self.data_parallel_size

    @property
    def run_uri(self) -> str:
        return storage.join(self.checkpoint.storage, self.run.name)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _batch_for(lo: int, hi: int) -> int:
    """The smallest global batch every size in [lo, hi] divides (a suggestion in an error)."""
    import math

    out = 1
    for n in range(lo, hi + 1):
        out = out * n // math.gcd(out, n)
    return out


def reference_markdown() -> str:
    """Every config key with type, default and meaning: docs/CONFIG.md is generated from this."""
    lines = ["# Config reference", "",
             "Generated by `raytrain config --reference`; every key can be set in a recipe YAML or as a",
             "dotted override (`raytrain train --config tiny optim.lr=3e-4`), and the same dotted keys",
             "name Tune search-space dimensions.", ""]
    for section, field in Config.model_fields.items():
        cls = field.annotation
        lines += [f"## `{section}`", "", (cls.__doc__ or "").strip(), "", "| key | type | default | meaning |",
                  "| --- | --- | --- | --- |"]
        lines += _reference_rows(section, cls) + [""]
    lines += ["## Retired keys", "", "Files and saved configs that hold them still load (the key is dropped with a",
              "warning); an override or search-space key naming one is an error.", "", "| key | why |", "| --- | --- |"]
    lines += [f"| `{k}` | {why} |" for k, why in RETIRED.items()] + [""]
    return "\n".join(lines + recipes_markdown())


def recipes_markdown() -> list[str]:
    """The shipped recipes (raytrain/recipes/), one row each: what its header says, the model, the workers."""
    rows = ["## Shipped recipes", "", "`--config NAME` takes one of these (or a path to your own YAML); "
            "`raytrain plan ... --write` writes one for a planned size.", "",
            "| recipe | model | workers | ZeRO | what |", "| --- | --- | --- | --- | --- |"]
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        cfg = load_config(path.stem)
        m = cfg.model
        head = next((line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        rows.append(f"| `{path.stem}` | {m.family}, {m.n_layer} x {m.hidden_size}, seq {m.seq_len} | "
                    f"`{cfg.scaling.num_workers}` | {cfg.deepspeed.zero_stage} | {head.removeprefix(path.stem + ': ')} |")
    return rows + [""]


def _reference_rows(prefix: str, cls: type[BaseModel]) -> list[str]:
    """One table row per key of a section; a nested section (metrics.wandb) gives one row per key of its own."""
    return [f"| `{key}` | `{ann}` | `{default}` | {meaning} |" for key, ann, default, meaning in key_rows(cls, prefix)]


def key_rows(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default as JSON, meaning) of every key of a section, a nested section's keys one by one: the
    reference tables of docs/CONFIG.md and `raytrain prepare --help`."""
    rows = []
    for name, f in cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            rows += key_rows(f.annotation, key)
            continue
        ann = str(f.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        ann = re.sub(r"raytrain(\.\w+)*\.", "", ann)
        default = f.default_factory() if f.default_factory else f.default
        rows.append((key, ann, json.dumps(default), f.description or ""))
    return rows


def resolve_recipe(name_or_path: str) -> Path:
    """`tiny` -> raytrain/recipes/tiny.yaml; anything with a suffix or slash is a path."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.is_file():
            raise UserError(f"config file not found: {name_or_path}")
        return p
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = ", ".join(sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")))
        raise UserError(f"unknown recipe {name_or_path!r}; known recipes: {known} (or pass a path to a .yaml file)")
    return candidate


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`a.b=1` pairs -> {"a.b": 1}. Values are YAML scalars, so `1e-4`, `true`, `null`, `[1,2]` work."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like key.path=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise UserError(f"override {item!r} has an empty key")
        try:
            value = load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str):
            value = _number_or_str(value)  # YAML 1.1 reads `3e-4` as a string; people mean a number
        out[key] = value
    return out


def _number_or_str(s: str) -> Any:
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


def check_key(dotted: str, root: type[BaseModel] = None) -> None:
    """Fail with the full dotted key when it names nothing in the schema (e.g. `no.such.key`)."""
    cls: Any = root or Config
    if cls is Config and dotted in RETIRED:
        raise UserError(f"config key {dotted!r} is no longer used: {RETIRED[dotted]}; leave it out")
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        field = cls.model_fields.get(part)
        if field is None:
            where = ".".join(parts[:i]) or "the top level"
            raise UserError(f"unknown config key {dotted!r}: {where} has no {part!r} "
                            f"(allowed: {', '.join(cls.model_fields)})")
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        elif i < len(parts) - 1 and not _is_dict(ann):
            raise UserError(f"unknown config key {dotted!r}: {'.'.join(parts[:i + 1])} is a value, not a section")
        elif _is_dict(ann):
            return  # free-form mapping (deepspeed.extra, scaling.resources_per_worker)


def _is_dict(ann: Any) -> bool:
    return getattr(ann, "__origin__", None) is dict


def apply_overrides(tree: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys in a nested dict. Unknown keys are caught by validation, which names them."""
    tree = copy.deepcopy(tree)
    for dotted, value in overrides.items():
        node = tree
        parts = dotted.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise UserError(f"config key {dotted!r}: {part!r} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return tree


def format_error(err: ValidationError, root: type[BaseModel] = None, what: str = "config") -> str:
    """A pydantic error -> one line naming each bad key (`what` names the kind of key: config, prepare, tune config)."""
    msgs = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            section = _section_for(e["loc"][:-1], root or Config)
            allowed = ", ".join(section.model_fields) if section else ""
            msgs.append(f"unknown {what} key {key!r} (allowed here: {allowed})")
        elif e["type"] == "literal_error":
            msgs.append(f"{what} key {key!r}: {e['msg'].lower()}, got {e.get('input')!r}")
        elif key:
            msg = e["msg"].removeprefix("Value error, ")  # ours: sentence case; keep the case of the names inside
            msgs.append(f"{what} key {key!r}: {msg[:1].lower() + msg[1:]} (got {e.get('input')!r})")
        else:
            msgs.append(f"{what}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(msgs)


def _section_for(loc: tuple, root: type[BaseModel]) -> Optional[type[BaseModel]]:
    cls: Any = root
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        cls = field.annotation
    return cls


def validate(tree: dict, root: type[BaseModel] = None, what: str = "config") -> Any:
    """A nested dict -> the validated `root` model (default Config); UserError with one line otherwise."""
    root = root or Config
    if root is Config:
        for key in _retired_in(tree):
            print(f"warning: config key {key!r} is no longer used: {RETIRED[key]}; remove it from the file",
                  file=sys.stderr)
    try:
        return root.model_validate(tree)
    except ValidationError as err:
        raise UserError(format_error(err, root, what)) from None


def read_tree(path: str | Path, top_level: str = "of sections (model:, data:, ...)") -> dict:
    """A YAML file (local path or s3://) -> its top-level mapping; one-line errors naming the file."""
    try:
        text = storage.read_text(str(path)) if storage.is_remote(str(path)) else Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        tree = load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path}: top level must be a mapping {top_level}")
    return tree


def set_keys(tree: dict, overrides: dict[str, Any], root: type[BaseModel] = None) -> dict:
    """Dotted overrides checked against `root`'s schema (full key named when unknown), then set in the tree."""
    for key in overrides:
        check_key(key, root)
    return apply_overrides(tree, overrides)


def load_tree(path: Optional[str | Path], overrides: Optional[list[str] | dict[str, Any]] = None,
              root: type[BaseModel] = None, what: str = "config", top_level: str = "of sections (model:, data:, ...)",
              place: Optional[Callable[[dict, dict[str, Any]], dict]] = None) -> Any:
    """The one config loader: YAML file (or nothing) + dotted overrides -> validated `root` model, one-line errors.

    Used by train (recipes), prepare, tune and cost. `place(tree, overrides)` puts the overrides into the
    tree when they are not all plain keys of `root` (tune routes training keys into its `overrides:`).
    """
    root = root or Config
    tree = read_tree(path, top_level) if path else {}
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else dict(overrides)
        tree = place(tree, ov) if place else set_keys(tree, ov, root)
    return validate(tree, root, what)


def load_config(name_or_path: Optional[str] = None, overrides: Optional[list[str] | dict[str, Any]] = None) -> Config:
    """Recipe (by name or path) + overrides -> validated Config. Raises UserError naming the bad key."""
    return load_tree(resolve_recipe(name_or_path) if name_or_path else None, overrides)
