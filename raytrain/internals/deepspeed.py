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
