"""Capacity planner: parameters, memory per device for each ZeRO stage / offload, a recommended setup, time and cost.

Model-state memory comes from DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`); activations from the formula in docs/PLANNING.md; the parameter
count from the real `transformers` model built on the meta device (no memory, exact for every family).
Host memory follows how raytrain builds the model (raytrain.model.build_model): ZeRO-3 under
`deepspeed.zero.Init`, ZeRO-0/1/2 in the training dtype; restore reads follow the checkpoint's files.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

from raytrain.config import ModelConfig, takes_chunked_loss
from raytrain.errors import UserError

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    memory_gib: float
    peak_tflops: float  # dense 16-bit tensor-core peak (bf16, or fp16 where bf16 is missing)
    on_demand: float  # USD per GPU-hour
    spot: float  # USD per GPU-hour


# Indicative public cloud list prices (USD per GPU-hour, 8-GPU instances divided by 8, 2025); spot prices move
# daily, so every figure can be overridden with --price-on-demand / --price-spot.
GPUS: dict[str, Gpu] = {
    "v100-32gb": Gpu(32, 125, 3.06, 0.95),
    "t4": Gpu(16, 65, 0.53, 0.20),
    "a10g": Gpu(24, 70, 1.01, 0.45),
    "l4": Gpu(24, 121, 0.80, 0.35),
    "l40s": Gpu(48, 362, 1.86, 0.80),
    "a100-40gb": Gpu(40, 312, 2.75, 1.20),
    "a100-80gb": Gpu(80, 312, 3.40, 1.50),
    "h100": Gpu(80, 989, 4.90, 2.30),
    "h200": Gpu(141, 989, 5.60, 2.80),
    "b200": Gpu(180, 2250, 8.50, 4.00),
    "mi300x": Gpu(192, 1307, 4.90, 2.50),
}

# Standard shapes: GPT-2 sizes (OpenAI), Llama sizes (Meta; 10b is a 48-layer 7b), Mixtral 8x7b.
SIZES: dict[str, dict] = {
    "124m": dict(family="gpt2", n_layer=12, hidden_size=768, n_head=12, seq_len=1024),
    "350m": dict(family="gpt2", n_layer=24, hidden_size=1024, n_head=16, seq_len=1024),
    "774m": dict(family="gpt2", n_layer=36, hidden_size=1280, n_head=20, seq_len=1024),
    "1.5b": dict(family="gpt2", n_layer=48, hidden_size=1600, n_head=25, seq_len=1024),
    "1b": dict(family="llama", tie_embeddings=False, n_layer=16, hidden_size=2048, n_head=32, n_kv_head=8, intermediate_size=8192, seq_len=2048),
    "3b": dict(family="llama", tie_embeddings=False, n_layer=26, hidden_size=3200, n_head=32, intermediate_size=8640, seq_len=2048),
    "7b": dict(family="llama", tie_embeddings=False, n_layer=32, hidden_size=4096, n_head=32, intermediate_size=11008, seq_len=2048),
    "8b": dict(family="llama", tie_embeddings=False, n_layer=32, hidden_size=4096, n_head=32, n_kv_head=8, intermediate_size=14336,
               vocab_size=128256, seq_len=8192),
    "10b": dict(family="llama", tie_embeddings=False, n_layer=48, hidden_size=4096, n_head=32, intermediate_size=11008, seq_len=2048),
    "13b": dict(family="llama", tie_embeddings=False, n_layer=40, hidden_size=5120, n_head=40, intermediate_size=13824, seq_len=2048),
    "33b": dict(family="llama", tie_embeddings=False, n_layer=60, hidden_size=6656, n_head=52, intermediate_size=17920, seq_len=2048),
    "70b": dict(family="llama", tie_embeddings=False, n_layer=80, hidden_size=8192, n_head=64, n_kv_head=8, intermediate_size=28672, seq_len=4096),
    "8x7b": dict(family="mixtral", tie_embeddings=False, n_layer=32, hidden_size=4096, n_head=32, n_kv_head=8, intermediate_size=14336,
                 moe_experts=8, moe_top_k=2, seq_len=4096),
}
DEFAULT_VOCAB = {"gpt2": 50257, "llama": 32000, "mixtral": 32000}

# Strategies from cheapest to most memory-frugal: (name, zero stage, offload_optimizer, offload_param, relative
# throughput). The throughput factors are rules of thumb (ZeRO-3's extra parameter all-gathers, PCIe traffic of
# offload), used to rank choices and to scale the MFU assumption; measure your own with `raytrain tune`.
STRATEGIES = [
    ("zero0", 0, False, False, 1.0),
    ("zero1", 1, False, False, 1.0),
    ("zero2", 2, False, False, 1.0),
    ("zero3", 3, False, False, 0.9),
    ("zero2+offload_opt", 2, True, False, 0.6),
    ("zero3+offload_opt", 3, True, False, 0.55),
    ("zero3+offload_all", 3, True, True, 0.4),
]
CHECKPOINTING_FACTOR = 0.75  # recomputing the forward: ~4/3 of the FLOPs for the same tokens
# CUDA context (~0.5 GiB), NCCL buffers and DeepSpeed's reduce / all-gather / prefetch buckets (5e8 elements
# by default, 16-bit): not part of DeepSpeed's model-state estimators, paid on every device.
RUNTIME_OVERHEAD_GIB = 3.0
# Host memory of one rank's process apart from model states: Python, torch, the CUDA host libraries and context.
HOST_RUNTIME_GIB_PER_RANK = 3.0
# DeepSpeed's estimators' margin on host memory (their additional_buffer_factor).
HOST_BUFFER_FACTOR = 1.5
# Bytes per parameter in a checkpoint (mixed precision, Adam): the 16-bit weights (2) and the fp32 master
# weights, momentum and variance (12).
CKPT_WEIGHT_BYTES, CKPT_OPTIM_BYTES = 2, 12
# GPU instance types the cluster configs in cluster/ launch: (GPU type, GPUs, host memory GiB), from the
# providers' instance tables.
INSTANCES: dict[str, tuple[str, int, float]] = {
    "g5.xlarge": ("a10g", 1, 16), "g6.xlarge": ("l4", 1, 16), "g4dn.xlarge": ("t4", 1, 16),
    "g2-standard-8": ("l4", 1, 32), "a2-highgpu-1g": ("a100-40gb", 1, 85),
    "p4d.24xlarge": ("a100-40gb", 8, 1152), "p4de.24xlarge": ("a100-80gb", 8, 1152),
    "p5.48xlarge": ("h100", 8, 2048), "a3-highgpu-8g": ("h100", 8, 1872), "a2-ultragpu-8g": ("a100-80gb", 8, 1360),
}
# Tokens per micro-batch below which accelerators run their matmuls inefficiently: plans reaching it are preferred.
EFFICIENT_MICRO_BATCH_TOKENS = 4096


@dataclass
class Shape:
    """What memory and FLOPs depend on, read from the built model."""

    family: str
    n_layer: int
    hidden: int
    n_head: int
    kv_hidden: int  # hidden size of K (and of V): n_kv_head * head_dim
    intermediate: int
    vocab: int
    seq_len: int
    experts: int = 1
    top_k: int = 1
    params: int = 0
    active_params: int = 0  # per token: MoE tokens see top_k experts, not all of them
    largest_layer_params: int = 0
    eager_attention: bool = False
    loss: str = "auto"  # model.loss: whether a ZeRO stage trains with the chunked loss (config.takes_chunked_loss)
    lora: bool = False


def model_config_for(spec: str, seq_len: Optional[int] = None) -> ModelConfig:
    """`10b`, `124m`, a recipe name (`tiny`) or a recipe / config YAML path -> the model section."""
    key = spec.lower()
    if key in SIZES:
        shape = dict(SIZES[key])
        if seq_len:
            shape["seq_len"] = seq_len
        return ModelConfig(**shape)
    from raytrain.config import load_config

    try:
        m = load_config(spec).model
    except UserError as e:
        raise UserError(f"--model {spec!r}: not a known size ({', '.join(SIZES)}) nor a usable config ({e})") from None
    return m.model_copy(update={"seq_len": seq_len}) if seq_len else m


def shape_keys(spec: str, cfg: ModelConfig) -> dict:
    """The model keys that make a planned size: a size's own entry of SIZES, or a recipe's shape keys that are set."""
    moe = ("moe_experts", "moe_top_k") if cfg.family == "mixtral" else ()
    keys = SIZES.get(spec.lower()) or ("family", "n_layer", "hidden_size", "n_head", "n_kv_head", "intermediate_size",
                                       *moe, "seq_len")
    got = cfg.model_dump()
    return {k: got[k] for k in keys if got.get(k) is not None}


def shape_of(cfg: ModelConfig, vocab: Optional[int] = None) -> Shape:
    """Builds the real transformers model on the meta device (no memory) and reads its sizes."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain.model import hf_config, param_counts

    vocab = vocab or cfg.vocab_size or DEFAULT_VOCAB[cfg.family]
    hfc = hf_config(cfg, vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hfc)
    total, active = param_counts(model, cfg)
    # DeepSpeed's definition (stage3.model_to_params): the most parameters held directly by one module.
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    head_dim = cfg.hidden_size // cfg.n_head
    inter = hfc.n_inner or 4 * cfg.hidden_size if cfg.family == "gpt2" else hfc.intermediate_size
    experts, top_k = (cfg.moe_experts, cfg.moe_top_k) if cfg.family == "mixtral" else (1, 1)
    return Shape(family=cfg.family, n_layer=cfg.n_layer, hidden=cfg.hidden_size, n_head=cfg.n_head,
                 kv_hidden=(cfg.n_kv_head or cfg.n_head) * head_dim if cfg.family != "gpt2" else cfg.hidden_size,
                 intermediate=inter, vocab=vocab, seq_len=cfg.seq_len, experts=experts, top_k=top_k, params=total,
                 active_params=active, largest_layer_params=largest,
                 eager_attention=cfg.attn_implementation == "eager", loss=cfg.loss, lora=cfg.lora.r > 0)


def model_states_bytes(shape: Shape, stage: int, offload_opt: bool, offload_param: bool, gpus: int,
                       gpus_per_node: int) -> tuple[int, int]:
    """(per device, per node host) bytes of params, gradients and optimizer states.

    Device: DeepSpeed's estimators. They cover stages 2 and 3; stage 0 is stage 2 on one device (nothing
    sharded) and stage 1 is stage 2 plus the unsharded 16-bit gradients (2 bytes/param on every device).
    Host, per node (HOST_BUFFER_FACTOR margin, as DeepSpeed's):
      ZeRO-3: DeepSpeed's zero_init=True figure - raytrain builds under deepspeed.zero.Init, so a rank holds one
        layer at a time in full and keeps 1/N of the states (offloaded ones on the host: states / nodes).
      ZeRO-0/1/2: each rank builds the whole model once, in the 16-bit training dtype, plus (optimizer offload)
        its 1/N of the fp32 optimizer states and gradients (16 bytes/param).
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p = shape.params
    per_node, nodes = min(gpus, gpus_per_node), math.ceil(gpus / gpus_per_node)
    if stage == 3:
        cpu, dev, _ = estimate_zero3_model_states_mem_needs(
            p, shape.largest_layer_params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload_opt,
            cpu_offload_params=offload_param, zero_init=True, additional_buffer_factor=HOST_BUFFER_FACTOR)
        return dev, cpu
    _, dev = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=per_node, num_nodes=nodes,
                                                   cpu_offload=offload_opt)
    cpu = int(HOST_BUFFER_FACTOR * (per_node * 2 * p + (16 * p / nodes if offload_opt else 0)))
    if stage == 0:  # nothing sharded: one device's worth of everything, on every device
        dev = estimate_zero2_model_states_mem_needs(p, 1, 1, cpu_offload=False)[1]
    if stage == 1:
        dev += int(2 * p * (1 - 1 / (per_node * nodes)))
    return dev, cpu


def host_bytes_per_node(shape: Shape, stage: int, offload_opt: bool, offload_param: bool, gpus: int,
                        gpus_per_node: int) -> int:
    """Host RAM one node needs: its ranks' model states on the host and each rank's process."""
    ranks = min(gpus, gpus_per_node)
    return model_states_bytes(shape, stage, offload_opt, offload_param, gpus, gpus_per_node)[1] + int(
        ranks * HOST_RUNTIME_GIB_PER_RANK * GIB)


def checkpoint_bytes(shape: Shape) -> int:
    return (CKPT_WEIGHT_BYTES + CKPT_OPTIM_BYTES) * shape.params


def restore_bytes_per_node(shape: Shape, stage: int, gpus: int, gpus_per_node: int) -> int:
    """Bytes one node downloads on restore: only the files its ranks read (raytrain.ckpt.restore.files_for_rank).

    ZeRO-3: each rank's weight and optimizer partition (1/N each). ZeRO-1/2: the one shared 16-bit weights file
    and the node's ranks' optimizer partitions. ZeRO-0: everything (no partitions).
    """
    p, share = shape.params, min(gpus, gpus_per_node) / gpus
    if stage == 3:
        return int(checkpoint_bytes(shape) * share)
    if stage in (1, 2):
        return int(CKPT_WEIGHT_BYTES * p + CKPT_OPTIM_BYTES * p * share)
    return checkpoint_bytes(shape)


def activation_bytes(shape: Shape, micro_batch: int, checkpointing: bool, dtype_bytes: int = 2, *,
                     chunked: bool = False) -> int:
    """Activations kept for backward at one micro-batch (docs/PLANNING.md has the derivation).

    Per layer and token, in elements of the training dtype (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1, without dropout masks, generalised to any MLP width):
      GPT-2 (LayerNorm, GELU MLP):      attention 5h, MLP h + 2i, norms 2h         -> 8h + 2i   (= 16h at i = 4h)
      Llama (RMSNorm, SwiGLU, GQA):     attention 3h + 2kv, MLP h + 4i, norms 2h   -> 6h + 2kv + 4i
      Mixtral: the MLP term is paid by each of the top_k experts a token is routed to, plus E router logits.
      eager attention adds the softmax output, n_head * seq_len per token (SDPA/flash kernels keep none).
    Activation checkpointing keeps each layer's input (h) and recomputes one layer at a time.
    The LM head adds vocab * (dtype + 8) bytes per token: the logits, their fp32 log-softmax (kept by the
    loss) and its gradient; with the chunked loss (`chunked`, raytrain/worker/linear_ce.py) one chunk's fp32 logits
    and their gradient, and the output projection's fp32 gradient, whatever the micro-batch.
    """
    h, i, kv, k = shape.hidden, shape.intermediate, shape.kv_hidden, shape.top_k
    if shape.family == "gpt2":
        layer = 8 * h + 2 * i
    else:
        layer = 6 * h + 2 * kv + k * (h + 4 * i) + (shape.experts if shape.experts > 1 else 0)
    if shape.eager_attention:
        layer += shape.n_head * shape.seq_len
    tokens = micro_batch * shape.seq_len
    kept = shape.n_layer * h + layer if checkpointing else shape.n_layer * layer
    if chunked:
        from raytrain.worker.linear_ce import chunked_head_bytes

        head = chunked_head_bytes(tokens, h, shape.vocab)
    else:
        head = tokens * shape.vocab * (dtype_bytes + 8)
    return int(tokens * kept * dtype_bytes + head)


@dataclass
class Option:
    strategy: str
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    activation_checkpointing: bool
    model_states_gib: float
    host_gib_per_node: float
    activations_gib_per_sample: float
    total_gib_at_micro_batch: float  # at the plan's micro-batch (or 1 when it does not fit at all)
    max_micro_batch: int  # 0: does not fit
    fits: bool
    host_fits: bool  # host RAM per node holds the offloaded states and the model as built
    throughput_factor: float
    restore_gib_per_node: float = 0.0  # what one node downloads to resume
    restore_s: float = 0.0  # at the plan's per-node bandwidth


@dataclass
class Plan:
    model: str
    family: str
    params: int
    active_params: int
    seq_len: int
    gpu: str
    gpu_memory_gib: float
    gpus: int
    gpus_per_node: int
    usable_gib: float
    options: list[Option] = field(default_factory=list)
    recommended: Optional[dict] = None
    fewest_gpus: dict = field(default_factory=dict)  # strategy -> fewest GPUs it fits on (micro-batch 1)
    checkpoint_gib: float = 0.0
    instances: list[dict] = field(default_factory=list)  # the instance types in cluster/*.yaml: do they fit?
    assumptions: dict = field(default_factory=dict)
    shape: dict = field(default_factory=dict)  # the model section's keys that make this size (model.<key> overrides)

    def to_dict(self) -> dict:
        return asdict(self)


def _fit(shape: Shape, gpu: Gpu, gpus: int, gpn: int, strat: tuple, ckpt: bool, usable: float, mb_cap: int,
         mb_fixed: Optional[int], host_limit: float) -> Option:
    name, stage, off_o, off_p, factor = strat
    dev, _ = model_states_bytes(shape, stage, off_o, off_p, gpus, gpn)
    host = host_bytes_per_node(shape, stage, off_o, off_p, gpus, gpn)
    chunked = takes_chunked_loss(shape.loss, zero_stage=stage, lora=shape.lora)
    per_sample = activation_bytes(shape, 1, ckpt, chunked=chunked)
    # Host memory too: offloaded states live there, and ZeRO-0/1/2 ranks build the whole model on the host.
    free = usable - dev - RUNTIME_OVERHEAD_GIB * GIB if host <= host_limit else -1
    best = 0
    for mb in ([mb_fixed] if mb_fixed else [2**j for j in range(int(math.log2(mb_cap)) + 1)]):
        if activation_bytes(shape, mb, ckpt, chunked=chunked) <= free:
            best = mb
    mb_used = best or mb_fixed or 1
    total = dev + RUNTIME_OVERHEAD_GIB * GIB + activation_bytes(shape, mb_used, ckpt, chunked=chunked)
    return Option(name + ("+ckpt" if ckpt else ""), zero_stage=stage, offload_optimizer=off_o, offload_param=off_p,
                  activation_checkpointing=ckpt, model_states_gib=dev / GIB, host_gib_per_node=host / GIB,
                  activations_gib_per_sample=per_sample / GIB, total_gib_at_micro_batch=total / GIB,
                  max_micro_batch=best, fits=best > 0, host_fits=host <= host_limit,
                  throughput_factor=factor * (CHECKPOINTING_FACTOR if ckpt else 1.0),
                  restore_gib_per_node=restore_bytes_per_node(shape, stage, gpus, gpn) / GIB)


def _best(options: list[Option], seq_len: int) -> Optional[Option]:
    # Fastest that fits, preferring micro-batches big enough to keep the matmuls efficient; ties go to less
    # sharding (fewer collectives), then to larger micro-batches.
    fitting = [o for o in options if o.fits]
    if not fitting:
        return None
    return max(fitting, key=lambda o: (o.max_micro_batch * seq_len >= EFFICIENT_MICRO_BATCH_TOKENS,
                                       o.throughput_factor, -o.zero_stage, o.max_micro_batch))


def parse_tokens(text: str) -> float:
    """`300B`, `1.4T`, `50M`, `2e11` -> tokens."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not m:
        raise UserError(f"--tokens {text!r}: use a number like 300B, 1.4T, 50M or 2e11")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


def make_plan(model: str, gpu: str, gpus: int, seq_len: Optional[int] = None, tokens: Optional[float] = None,
              micro_batch: Optional[int] = None, mfu: float = 0.4, gpus_per_node: int = 8,
              global_batch_tokens: int = 2**20, headroom: float = 0.9, vocab: Optional[int] = None,
              price_on_demand: Optional[float] = None, price_spot: Optional[float] = None,
              max_micro_batch: int = 64, host_memory_gib: float = 1024.0, node_gbps: float = 10.0,
              cluster_dir: Optional[str] = None) -> Plan:
    key = gpu.lower()
    if key not in GPUS:
        raise UserError(f"--gpu {gpu!r} is not in the table ({', '.join(GPUS)}); pick the closest one and "
                        f"override prices with --price-on-demand / --price-spot")
    if gpus < 1 or gpus_per_node < 1:
        raise UserError("--gpus and --gpus-per-node must be >= 1")
    if node_gbps <= 0:
        raise UserError(f"--node-gbps {node_gbps}: a node's network bandwidth to storage in Gbit/s, e.g. 10")
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu}: model FLOPs utilisation is a fraction in (0, 1], e.g. 0.4")
    g = GPUS[key]
    mcfg = model_config_for(model, seq_len)
    shape = shape_of(mcfg, vocab)
    usable = g.memory_gib * headroom * GIB
    host = host_memory_gib * GIB
    opts = [_fit(shape, g, gpus, gpus_per_node, strat, ckpt, usable, max_micro_batch, micro_batch, host)
            for ckpt in (False, True) for strat in STRATEGIES]
    plan = Plan(model=model, family=shape.family, params=shape.params, active_params=shape.active_params,
                seq_len=shape.seq_len, gpu=key, gpu_memory_gib=g.memory_gib, gpus=gpus,
                gpus_per_node=gpus_per_node, usable_gib=usable / GIB, options=opts,
                checkpoint_gib=checkpoint_bytes(shape) / GIB, shape=shape_keys(model, mcfg))
    for o in opts:
        o.restore_s = o.restore_gib_per_node * GIB * 8 / (node_gbps * 1e9)
    plan.instances = instance_fits(shape, gpus, headroom, max_micro_batch, micro_batch, cluster_dir)
    for strat in STRATEGIES:
        for ckpt in (False, True):
            n = 1
            while n <= 65536 and not _fit(shape, g, n, gpus_per_node, strat, ckpt, usable, 1, 1, host).fits:
                n *= 2
            plan.fewest_gpus[strat[0] + ("+ckpt" if ckpt else "")] = n if n <= 65536 else None
    from raytrain.model import flops_per_token as model_flops_per_token  # the one the training loop's MFU uses

    flops_per_token = model_flops_per_token(shape.active_params, mcfg)
    od = g.on_demand if price_on_demand is None else price_on_demand
    sp = g.spot if price_spot is None else price_spot
    plan.assumptions = {
        "mfu": mfu, "peak_tflops_per_gpu": g.peak_tflops, "memory_headroom": headroom,
        "runtime_overhead_gib": RUNTIME_OVERHEAD_GIB, "host_memory_gib_per_node": host_memory_gib,
        "host_runtime_gib_per_rank": HOST_RUNTIME_GIB_PER_RANK, "node_gbps": node_gbps, "dtype": "bf16/fp16 mixed precision (Adam)",
        "flops_per_token": flops_per_token, "price_on_demand_per_gpu_h": od, "price_spot_per_gpu_h": sp,
        "global_batch_tokens_target": global_batch_tokens, "vocab": shape.vocab,
    }
    best = _best(opts, shape.seq_len)
    if best is not None:
        mb = best.max_micro_batch
        acc = max(1, round(global_batch_tokens / (mb * shape.seq_len * gpus)))
        tps = mfu * best.throughput_factor * g.peak_tflops * 1e12 * gpus / flops_per_token
        rec = {"strategy": best.strategy, "zero_stage": best.zero_stage,
               "offload_optimizer": "cpu" if best.offload_optimizer else "none",
               "offload_param": "cpu" if best.offload_param else "none",
               "activation_checkpointing": best.activation_checkpointing, "micro_batch_size": mb,
               "gradient_accumulation_steps": acc, "global_batch_sequences": mb * acc * gpus,
               "global_batch_tokens": mb * acc * gpus * shape.seq_len, "nodes": math.ceil(gpus / gpus_per_node),
               "memory_gib_per_gpu": best.total_gib_at_micro_batch, "tokens_per_s": tps,
               "overrides": _overrides(best, mb, acc, gpus, gpus_per_node)}
        if tokens:
            hours = tokens / tps / 3600
            rec.update({"tokens": tokens, "wall_clock_h": hours, "gpu_hours": hours * gpus,
                        "cost_on_demand_usd": hours * gpus * od, "cost_spot_usd": hours * gpus * sp})
        plan.recommended = rec
    return plan


def cluster_instance_types(cluster_dir: Optional[str] = None) -> dict[str, str]:
    """{instance type: config file} of the GPU node types the cluster configs launch."""
    import glob
    import os

    import yaml

    d = cluster_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster")
    out: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(d, "*.yaml"))):
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        for node in (doc.get("available_node_types") or {}).values():
            nc = node.get("node_config") or {}
            name = nc.get("InstanceType") or nc.get("machineType")
            if name in INSTANCES:  # CPU-only head types are not in the GPU table
                out.setdefault(name, os.path.basename(path))
    return out


def instance_fits(shape: Shape, gpus: int, headroom: float, mb_cap: int, mb_fixed: Optional[int],
                  cluster_dir: Optional[str] = None) -> list[dict]:
    """For each GPU instance type in cluster/: its GPU and host memory, and the first strategy (cheapest
    first) that fits both with `gpus` GPUs in all."""
    rows = []
    for name, source in cluster_instance_types(cluster_dir).items():
        gkey, gpn, host_gib = INSTANCES[name]
        g = GPUS[gkey]
        fit = None
        for ckpt in (False, True):
            for strat in STRATEGIES:
                o = _fit(shape, g, gpus, gpn, strat, ckpt, g.memory_gib * headroom * GIB, mb_cap, mb_fixed,
                         host_gib * GIB)
                if o.fits and fit is None:
                    fit = o
        need = min(host_bytes_per_node(shape, s[1], s[2], s[3], gpus, gpn) for s in STRATEGIES) / GIB
        rows.append({"instance": name, "config": source, "gpu": gkey, "gpus_per_node": gpn, "host_gib": host_gib,
                     "fits": fit is not None, "strategy": fit.strategy if fit else None,
                     "host_gib_per_node_needed": fit.host_gib_per_node if fit else need})
    return rows


def human_params(n: int) -> str:
    """8030261248 -> 8.03B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


PLACEHOLDER = "s3://CHANGE-ME"  # where a written recipe's storage goes: the one edit it needs


def recipe(plan: Plan, command: str) -> str:
    """The plan's recommended setup as a recipe `raytrain train --config` takes (YAML with a header saying what was
    planned): the size's shape, the ZeRO stage and offload, `micro_batch_size: auto` at the planned global batch,
    checkpoints at the Young-Daly interval; storage and data under PLACEHOLDER, marked EDIT."""
    import yaml

    from raytrain.config import Config
    from raytrain.elastic.size_table import snapshot_bytes

    r = plan.recommended
    if r is None:
        raise UserError(f"nothing fits on {plan.gpus} x {plan.gpu}: no recipe to write (see the plan's table)")
    tree = {"model": {**plan.shape, **({"activation_checkpointing": True} if r["activation_checkpointing"] else {})},
            "data": {"train": f"{PLACEHOLDER}/data/corpus/train", "val": f"{PLACEHOLDER}/data/corpus/val"},
            "batch": {"micro_batch_size": "auto", "gradient_accumulation_steps": None,
                      "global_batch_size": r["global_batch_sequences"]},
            "precision": {"dtype": "auto"},
            "deepspeed": {"zero_stage": r["zero_stage"],
                          **{k: r[k] for k in ("offload_optimizer", "offload_param") if r[k] != "none"}},
            "scaling": {"num_workers": plan.gpus, "use_gpu": True},
            "checkpoint": {"storage": f"{PLACEHOLDER}/runs", "every_n_steps": "auto"},
            "run": {"name": f"{plan.family}-{plan.model}".replace(".", "_")}}
    cfg = Config.model_validate(tree)  # what train will take, or a one-line error here rather than there
    per_node = min(plan.gpus, plan.gpus_per_node)
    snaps = snapshot_bytes(cfg, plan.gpus, plan.params) * per_node / GIB
    host = next(o.host_gib_per_node for o in plan.options if o.strategy == r["strategy"])
    head = [f"# {command}",
            f"# Planned: {human_params(plan.params)} parameters with a vocabulary of {plan.assumptions['vocab']:,} (the "
            f"prepared data's tokenizer sets it), {r['strategy']} on {plan.gpus} x {plan.gpu}, {plan.gpus_per_node} "
            "per node; peak GPU memory "
            f"~{r['memory_gib_per_gpu']:.1f} GiB of {plan.usable_gib:.1f} usable per GPU at micro-batch "
            f"{r['micro_batch_size']} (auto measures it at the start); host memory per node ~{host + snaps:,.1f} GiB "
            f"({host:,.1f} for the model and states, {snaps:,.1f} for the host-memory snapshots: "
            "checkpoint.memory_every_n_steps=0 turns them off)",
            f"# EDIT: {PLACEHOLDER} below (data.train, data.val: a prepared dataset; checkpoint.storage)"]
    body = yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)
    return "\n".join(head) + "\n" + body


def _overrides(o: Option, mb: int, acc: int, gpus: int, gpn: int) -> list[str]:
    out = [f"deepspeed.zero_stage={o.zero_stage}", f"batch.micro_batch_size={mb}",
           f"batch.gradient_accumulation_steps={acc}", f"scaling.num_workers={gpus}", "scaling.use_gpu=true"]
    if o.offload_optimizer:
        out.append("deepspeed.offload_optimizer=cpu")
    if o.offload_param:
        out.append("deepspeed.offload_param=cpu")
    if o.activation_checkpointing:
        out.append("model.activation_checkpointing=true")
    return out
