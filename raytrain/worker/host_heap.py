"""glibc's heap in a training worker: full-size blocks (start-up's, ZeRO-3's gathered layers) handed back to the OS.

glibc serves a large allocation from its own mapping until one such block is freed; from then on its mmap threshold
follows the largest block freed (up to 32 MiB), so the model build's and the first step's full-size tensors come back
on the heap, and a heap keeps what was freed. Under ZeRO-3 that held about two full fp32 copies of the model in
every worker's peak RSS (peak above a 1-layer model 1 / 0.73 / 0.49 at 1 / 2 / 4 workers: docs/BENCHMARKS.md).
A fixed 64 KiB threshold for the whole run returns them (1 / 0.52 / 0.31) but costs CPU steps 0.6x. So: 64 KiB
only through start-up (`start`), until the first step is done; then (`steady`) the thresholds glibc's own
adjustment would reach, what was freed trimmed, and the steps run as without any of this.

Except where ZeRO-3 partitions the model over several ranks: there every step gathers each layer's weights and
gradients at full size (blocks of 1 to 30 MiB, freed within the step) between the partitions that stay, and a heap
grows by hundreds of MiB per step that it cannot give back (peak above a 1-layer model 1 / 0.69 / 0.46 at 1 / 2 / 4
workers). With 1 MiB blocks and up in mappings of their own the peak falls like 1/N (1 / 0.50 / 0.31); the page
faults of those fresh mappings cost a CPU step about 0.8x (GPU steps make few such host allocations).

Leaves glibc alone where the user set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (those win), and does
nothing on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Optional

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
START_MMAP = 64 * 1024
STEADY_MMAP = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its own adjustment ends
STEADY_TRIM = 2 * STEADY_MMAP  # and the trim threshold it sets beside it
PARTITIONED_MMAP = 1024 * 1024  # under ZeRO-3 on several ranks: the gathered layers' blocks are 1 MiB and up


def _libc() -> Optional[ctypes.CDLL]:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def start() -> bool:
    """Before the model is built: every block of 64 KiB and more gets a mapping of its own. True if set."""
    libc = _libc()
    return bool(libc and libc.mallopt(_M_MMAP_THRESHOLD, START_MMAP))


def steady_mmap_threshold(*, zero_stage: int, dp_size: int) -> int:
    """The mmap threshold from the first step on: 1 MiB where ZeRO-3 partitions the model, else glibc's own 32 MiB."""
    return PARTITIONED_MMAP if zero_stage == 3 and dp_size > 1 else STEADY_MMAP


def steady(*, zero_stage: int, dp_size: int) -> None:
    """After the first step: the steady thresholds for this run's ZeRO stage and data-parallel size, and the heap's
    free memory returned."""
    libc = _libc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, steady_mmap_threshold(zero_stage=zero_stage, dp_size=dp_size))
        libc.mallopt(_M_TRIM_THRESHOLD, STEADY_TRIM)
        libc.malloc_trim(0)
