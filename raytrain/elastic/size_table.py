"""The usable sizes of a run as lines a person reads: micro-batch, accumulation and host-snapshot bytes per size."""

from __future__ import annotations

from typing import Optional

from raytrain.config import Config

# A host snapshot holds fp32 weights and Adam's two moments of the rank's partition (raytrain/ckpt/host_snapshots.py),
# two generations of them, and each node also holds one generation of another node's ranks (the peer copy).
SNAPSHOT_BYTES_PER_PARAM = 12
COPIES_PER_RANK = 3


def snapshot_bytes(cfg: Config, workers: int, n_params: int) -> int:
    """Host memory a rank's snapshots take at this size (its two generations and one peer copy it holds for another
    node's rank): the ZeRO partition shrinks as the size grows."""
    tp = cfg.deepspeed.tensor_parallel_size
    shards = workers if cfg.deepspeed.zero_stage >= 1 else tp  # ZeRO-0 keeps the whole state on every rank
    return COPIES_PER_RANK * SNAPSHOT_BYTES_PER_PARAM * n_params // max(1, shards)


def lines(cfg: Config, n_params: Optional[int] = None, per_node: int = 1) -> list[str]:
    """One line per usable size (a fixed size: its one line), `per_node` ranks on a full node. Snapshot bytes only
    where the parameter count is known (a vocabulary taken from the data is known once the data is read)."""
    s = cfg.scaling
    head = (f"[raytrain] sizes of scaling.num_workers={s.num_workers}" if s.elastic else "[raytrain] size")
    out = [head + ": workers | micro-batch x accumulation | host snapshots per rank | per node of "
           f"{per_node} rank{'s' if per_node > 1 else ''}"]
    for n, (mb, acc) in sorted(cfg.sizes().items()):
        batch = "auto (chosen at train start)" if mb is None else f"{mb} x {acc}"
        if n_params is None:
            snap = "-"
        else:
            b = snapshot_bytes(cfg, n, n_params)
            snap = f"{_gib(b)} | {_gib(b * min(per_node, n))}"
        out.append(f"[raytrain]   {n:>4} | {batch} | {snap}")
    return out


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"
