"""Reaches into DeepSpeed's private code (written for deepspeed 0.19.8, the pin), each gated: see raytrain/internals/__init__.py.

Nothing here imports DeepSpeed at module import.
"""

from __future__ import annotations

import sys
from typing import Optional

from raytrain.internals.registry import fell_back, gate, register

V = "0.19.8"

ZERO_STATE = register(
    "deepspeed.zero_optimizer_state", package="deepspeed", written_for=V,
    gain="host-memory snapshots: a rank's ZeRO partition captured after the step and put back into a new engine "
         "(ZeRO optimizer classes, load_state_dict(load_from_fp32_weights=...), update_lp_params): a fault without "
         "notice redoes at most one step instead of everything since the last storage checkpoint",
    fallback="memory snapshots off; a restart restores from the newest storage checkpoint")
NO_MLFLOW_AT_IMPORT = register(
    "deepspeed.no_mlflow_at_import", package="deepspeed", written_for=V,
    gain="DeepSpeed's import does not import mlflow (its autotuner, never used here, does when it is installed): "
         "1.6-2 s of every worker start on 2 cores, about a second on a GPU node, in every restart",
    fallback="DeepSpeed imports mlflow as it does by itself")
NO_SHM_OP = register(
    "deepspeed.no_shm_comm_op", package="deepspeed", written_for=V,
    gain="on CPU workers (laptops, CI, CPU nodes) DeepSpeed does not compile its shared-memory all-reduce op "
         "(45-100 s of gcc per environment), which only its CPU inference all-reduce would use; GPU runs never "
         "build it",
    fallback="DeepSpeed builds the op at the first CPU run of each environment, as it does by itself")

ZERO_RESHARD = register(
    "deepspeed.zero12_reshard", package="deepspeed", written_for=V,
    gain="an elastic run that shrinks after a node is lost without notice restores from the host-memory snapshots "
         "of the size before (each rank re-cuts its new ZeRO-1/2 partition from the old ranks' flat partitions that "
         "overlap it, about 2 x its own share of bytes whatever the number of workers): at most one step redone "
         "instead of everything since the last storage checkpoint",
    fallback="a change of size restores from the newest storage checkpoint (through DeepSpeed's universal form)")

ENGINE_COUNTERS = register(
    "deepspeed.engine_counters", package="deepspeed", written_for=V,
    gain="a restore from host memory puts the engine's step and sample counters back (DeepSpeed sets them only "
         "when it loads its own checkpoint files), so its schedules and logs go on from the restored step",
    fallback="memory snapshots off; a restart restores from the newest storage checkpoint")

ZERO_CLASSES = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def import_deepspeed_without_mlflow() -> None:
    """Import DeepSpeed with mlflow hidden for that one import (its try/except turns the autotuner's use off)."""
    blocked = gate(NO_MLFLOW_AT_IMPORT) and "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # an ImportError for `import mlflow`
    try:
        import deepspeed  # noqa: F401
    finally:
        if blocked:
            del sys.modules["mlflow"]


def skip_shm_comm_op() -> None:
    """Tell DeepSpeed its CPU shm all-reduce op cannot be built (so it is never compiled; gloo serves instead).
    DeepSpeed reads this table of buildable ops only where it sets up that op; filled in first, it also skips the
    probe of every op."""
    if not gate(NO_SHM_OP):
        return
    try:
        import deepspeed.ops

        vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    except Exception as e:  # noqa: BLE001
        fell_back(NO_SHM_OP, e)


def is_zero_optimizer(opt) -> bool:
    """A ZeRO optimizer whose partition the memory tier can capture (closed gate: none is)."""
    return type(opt).__name__ in ZERO_CLASSES and gate(ZERO_STATE)


def zero_state(opt) -> dict:
    """This rank's ZeRO partition: fp32 weights and optimizer state (references to live tensors)."""
    return opt.state_dict()


def zero_check(opt, state: dict) -> Optional[str]:
    """Why this rank's captured partition cannot go into this optimizer (None: it can). Local, no collective."""
    if not gate(ZERO_STATE):
        return "DeepSpeed's ZeRO internals are not the version the memory tier was written for"
    if type(opt).__name__ not in ZERO_CLASSES:
        return f"the engine's optimizer is {type(opt).__name__}, not a ZeRO optimizer"
    if not isinstance(state, dict) or not state:
        return "the snapshot holds no ZeRO optimizer state"
    return None


def zero_load(opt, state: dict) -> None:
    """Put this rank's captured partition back (collective: the 16-bit weights are all-gathered from the fp32
    partitions)."""
    import torch.distributed as dist

    group = getattr(opt, "dp_process_group", None)
    dp_rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    dp_size = dist.get_world_size(group=group) if dist.is_initialized() else 1
    per_rank = [None] * dp_size
    per_rank[dp_rank] = state
    if hasattr(opt, "checkpoint_event_prologue"):
        opt.checkpoint_event_prologue()
    opt.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
    if type(opt).__name__ == "DeepSpeedZeroOptimizer":
        opt.update_lp_params()  # ZeRO-1/2: the 16-bit weights from the fp32 partitions (ZeRO-3 does it inside)
    if hasattr(opt, "checkpoint_event_epilogue"):
        opt.checkpoint_event_epilogue()


def engine_counters_settable() -> bool:
    """Whether a restore from host memory may set the engine's counters (the gate of the reach)."""
    return gate(ENGINE_COUNTERS)


def set_engine_counters(engine, counters: dict) -> None:
    """The engine's global_steps, global_samples and skipped_steps, as captured."""
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]


def zero_reshard_possible() -> bool:
    """Whether ZeRO-1/2 partitions may be re-cut here (the gate of the reach)."""
    return gate(ZERO_RESHARD)


def _zero12_layout(opt, from_world: int) -> Optional[list[tuple[int, int, int, int]]]:
    """Per parameter group of a ZeRO-1/2 optimizer: (real elements of the flat group, this rank's partition start,
    its padded size now, a partition's padded size at `from_world` ranks); None where the optimizer is not one.
    DeepSpeed pads each group at its end to nccl_start_alignment_factor x ranks and cuts it into equal partitions;
    the elements before that padding (parameters and their alignment padding) are the same at every size."""
    import torch.distributed as dist

    if type(opt).__name__ != "DeepSpeedZeroOptimizer" or not gate(ZERO_RESHARD):
        return None
    out = []
    for i, part in enumerate(opt.single_partition_of_fp32_groups):
        group = opt.real_dp_process_group[i]
        real = sum(m.numel() + pad for m, pad in zip(opt.round_robin_bit16_meta[i], opt.round_robin_bit16_padding[i]))
        align = opt.nccl_start_alignment_factor * from_world
        out.append((real, dist.get_rank(group=group) * part.numel(), part.numel(), -(-real // align) * align // from_world))
    return out


def zero_reshard_sources(opt, from_world: int) -> Optional[list[int]]:
    """The ranks of a `from_world`-rank run whose ZeRO-1/2 partitions overlap this rank's partition now (what it
    reads to re-cut its own); None where this optimizer cannot be resharded from host memory."""
    layout = _zero12_layout(opt, from_world)
    if layout is None:
        return None
    need = set()
    for real, start, size, old in layout:
        end = min(start + size, real)
        need.update(k for k in range(from_world) if k * old < end and (k + 1) * old > start)
    return sorted(need)


def zero_reshard(opt, states: dict[int, dict], from_world: int) -> dict:
    """This rank's ZeRO-1/2 state now (what `zero_state` would have captured at this size), cut from the captured
    states of the old ranks overlapping it (`states`: old rank -> its zero_state). Raises ValueError when they do
    not fit together (another layout, a missing rank): the caller's vote sends every rank to storage."""
    import torch
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, GROUP_PADDINGS, PARTITION_COUNT,
                                               SINGLE_PARTITION_OF_FP32_GROUPS)

    layout = _zero12_layout(opt, from_world)
    if layout is None:
        raise ValueError("this optimizer is not DeepSpeed's ZeRO-1/2 optimizer of the version written for")
    first = states[min(states)]
    base = first[BASE_OPTIMIZER_STATE]
    fp32, opt_state = [], {}
    for i, (real, start, size, old) in enumerate(layout):
        end = min(start + size, real)
        pid = base["param_groups"][i]["params"][0]
        keys = base["state"].get(pid, {})
        pieces: dict = {"fp32": []}
        for k in range(from_world):
            lo, hi = max(start, k * old), min(end, (k + 1) * old)
            if lo >= hi:
                continue
            if k not in states:
                raise ValueError(f"the snapshot of rank {k} of {from_world} was not read")
            sd = states[k]
            held = sd[SINGLE_PARTITION_OF_FP32_GROUPS][i]
            if held.numel() != max(0, min(old, real - k * old)):
                raise ValueError(f"rank {k}'s partition of group {i} holds {held.numel()} elements, not the "
                                 f"{max(0, min(old, real - k * old))} its layout gives")
            pieces["fp32"].append(held[lo - k * old:hi - k * old])
            st = sd[BASE_OPTIMIZER_STATE]["state"].get(sd[BASE_OPTIMIZER_STATE]["param_groups"][i]["params"][0], {})
            for key, v in st.items():
                if torch.is_tensor(v) and v.numel() == old:  # partitioned (padded to the old partition's size)
                    pieces.setdefault(key, []).append(v[lo - k * old:hi - k * old])
        fp32.append(torch.cat(pieces["fp32"]) if pieces["fp32"] else torch.zeros(0, dtype=torch.float32))
        new = {}
        for key, v in keys.items():
            if key in pieces:  # zeros where the new partition runs past the real elements (DeepSpeed's padding)
                cut = torch.cat(pieces[key]) if pieces[key] else v.new_zeros(0)
                new[key] = torch.cat([cut, cut.new_zeros(size - cut.numel())])
            else:
                new[key] = v
        opt_state[pid] = new
    return {**first, SINGLE_PARTITION_OF_FP32_GROUPS: fp32, GROUP_PADDINGS: list(opt.groups_padding),
            PARTITION_COUNT: opt.partition_count,
            BASE_OPTIMIZER_STATE: {"state": opt_state, "param_groups": base["param_groups"]}}


MUON_ASIDE = register(
    "deepspeed.muon_set_aside", package="deepspeed", written_for=V,
    gain="DeepSpeed's engine imports its Muon optimizer's modules whatever the optimizer, and they torch.compile "
         "their kernels at import, which loads torch's compiler stack: 1.2-1.4 s of the engine phase of every worker "
         "start and restart here (recovery median 8.2-8.6 s without, docs/BENCHMARKS.md), about a second on a GPU "
         "node's CPU while model.compile is off (with it on, the compiler is loaded anyway and this gains nothing)",
    fallback="DeepSpeed imports its Muon modules as it does by itself")


def _muon_unavailable(*_, **__):
    raise RuntimeError("DeepSpeed's Muon optimizer was set aside in this process because its config named another "
                       "optimizer; set deepspeed.extra.optimizer.type=Muon to use it")


class _NotMuon:
    """Stands in for MuonWithAuxAdam in DeepSpeed's isinstance() checks: no optimizer of such a run is one."""

    __init__ = _muon_unavailable


# DeepSpeed's Muon modules, and what its engine imports from them (inside functions) whatever the optimizer.
MUON_STAND_INS = {"deepspeed.runtime.zero.muon.muon_optimizer": {"MuonWithAuxAdam": _NotMuon},
                  "deepspeed.runtime.zero.muon.original_muon": {"muon_update": _muon_unavailable}}
STAND_IN_MARK = "__raytrain_stand_in__"


def set_muon_aside(ds_config: dict) -> bool:
    """Before `deepspeed.initialize`: where the optimizer is not Muon, stand-ins answer what the engine asks of
    DeepSpeed's Muon modules, which are then never imported. A Muon config gets the real modules, also after an
    earlier engine of the process set them aside. True when the stand-ins are in place."""
    muon = str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"
    present = {m: sys.modules.get(m) for m in MUON_STAND_INS}
    ours = [m for m, mod in present.items() if mod is not None and getattr(mod, STAND_IN_MARK, False)]
    if muon:
        for m in ours:  # DeepSpeed imports them inside its functions: the next import finds the real ones
            del sys.modules[m]
        return False
    if ours:
        return True
    if any(mod is not None for mod in present.values()) or not gate(MUON_ASIDE):
        return False  # imported for real already, or DeepSpeed is not the version this was written for
    import types

    for module, names in MUON_STAND_INS.items():
        stand_in = types.ModuleType(module, "raytrain's stand-in: this process's optimizer is not Muon")
        vars(stand_in).update(names, **{STAND_IN_MARK: True})
        sys.modules[module] = stand_in
    return True
