"""Every reach into DeepSpeed's internals, in one place: written against deepspeed 0.19.8 (pinned in pyproject.toml).

Each is a small named function here so that a DeepSpeed upgrade means reading this one file. Nothing here imports
DeepSpeed at module import.
"""

from __future__ import annotations

import sys
import types


def _muon_unavailable(*_, **__):
    raise RuntimeError("DeepSpeed's Muon optimizer was set aside in this worker because its config names another "
                       "optimizer; set deepspeed.extra.optimizer.type=Muon to use it")


class _NotMuon:
    """Stands in for MuonWithAuxAdam in isinstance() checks: no optimizer of such a run is one."""

    __init__ = _muon_unavailable


# DeepSpeed's Muon modules, and what its engine imports from them whatever the optimizer.
MUON_STAND_INS = {"deepspeed.runtime.zero.muon.muon_optimizer": {"MuonWithAuxAdam": _NotMuon},
                  "deepspeed.runtime.zero.muon.original_muon": {"muon_update": _muon_unavailable}}


def set_muon_aside(ds_config: dict) -> bool:
    """Before `deepspeed.initialize` where the optimizer is not Muon: DeepSpeed's Muon modules left unimported.

    DeepSpeed's engine imports its Muon optimizer's modules whatever the optimizer (in its ZeRO check, each ZeRO
    stage's set-up, every ZeRO-1/2 gradient reduction) and only uses them when the optimizer is Muon; they
    torch.compile() their kernels at import, which loads torch's whole compiler stack: 1.4 s of CPU in every
    worker's start-up on these machines, a third of a recovery's engine phase (docs/BENCHMARKS.md). Stand-ins answer
    what the engine asks. A run configured with Muon (deepspeed.extra) gets the real modules. True when set aside.
    """
    muon = str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"
    if muon or any(m in sys.modules for m in MUON_STAND_INS):
        return False
    for module, names in MUON_STAND_INS.items():
        stand_in = types.ModuleType(module, "raytrain's stand-in: this process's optimizer is not Muon")
        vars(stand_in).update(names)
        sys.modules[module] = stand_in
    return True
