"""The content checksum of a global batch: of the rows the model trains on (their bytes), in global-batch order,
the same whatever the number of ranks and whichever reader delivered them.

Each rank sums (global lane + 1) x crc32(row) over its rows, mod a prime below 2**32; the shares ride the step's
all-reduce (exact in float64 for up to 2**21 ranks) and the sum, mod the prime, is the batch's checksum. The
lane weight makes it order-sensitive (two rows swapped change it). Rows are checksummed as int32 token ids, the
reader's dtype. `batch_crc32` fingerprints the plan's sample ids; this one fingerprints what was read.
"""

from __future__ import annotations

import zlib

import numpy as np

PRIME = 4294967291  # the largest prime below 2**32


def share(rows: np.ndarray, first_lane: int) -> int:
    """A rank's share for its rows, which are lanes first_lane, first_lane + 1, ... of the global batch."""
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    acc = 0
    for j in range(len(rows)):
        acc = (acc + (first_lane + j + 1) * zlib.crc32(rows[j])) % PRIME
    return acc


def combine(total: int, copies: int = 1) -> int:
    """The batch's checksum from the sum of every rank's share; `copies`: how many ranks hold each row (the ranks of
    one tensor-parallel group share their rows, so each share was added that many times)."""
    return (total % PRIME) * pow(copies, -1, PRIME) % PRIME


def of_batch(rows: np.ndarray) -> int:
    """The checksum of a whole global batch's rows (lanes 0 .. global_batch - 1), as one rank would log it."""
    return combine(share(rows, 0))
