"""data.transform: a user function run on every unit's rows as they are read, seeded by (run seed, epoch, unit), so a
resume or a resize gets the same rows; built in: fill-in-the-middle (`fim`).

The function is `fn(rows, *, rng, split, **data.transform_args) -> rows`: rows are a unit's [n, row_width] int32
token ids (text rows: seq_len + 1 each), rng a numpy Generator seeded by (run seed, epoch, unit), split the
prepared split (its tokenizer, seq_len); it returns rows of the same shape. The ray reader runs it in its Ray Data
tasks (CPU nodes), the direct reader in the worker's read threads: the same bytes either way. It is checked on the
driver, on the split's first unit, before any worker starts.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import numpy as np

from raytrain.errors import UserError, first_line

FIM_SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>")


class Transform:
    """data.transform and its arguments, applied to units."""

    def __init__(self, spec: str, args: Optional[dict], seed: int):
        self.spec, self.args, self.seed = spec, dict(args or {}), seed
        self.fn = load(spec)

    def __call__(self, rows: np.ndarray, *, epoch: int, unit: int, split) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, unit])
        try:
            out = self.fn(rows, rng=rng, split=split, **self.args)
        except Exception as e:  # noqa: BLE001 - named with the function and the unit
            raise UserError(f"data.transform {self.spec} raised {type(e).__name__} on unit {unit} (epoch {epoch}): "
                            f"{first_line(e)}") from None
        out = np.asarray(out)
        if out.shape != rows.shape or not np.issubdtype(out.dtype, np.integer):
            raise UserError(f"data.transform {self.spec} returned {out.dtype} rows of shape {out.shape} for a unit of "
                            f"{rows.shape}; it must return token ids of the shape it was given")
        return out.astype(np.int32, copy=False)

    def to_dict(self) -> dict:
        return {"spec": self.spec, "args": self.args, "seed": self.seed}

    @staticmethod
    def from_dict(d: Optional[dict]) -> Optional["Transform"]:
        return Transform(d["spec"], d["args"], d["seed"]) if d else None


def load(spec: str) -> Callable:
    """The function named `module:function` (a built-in name alone, e.g. `fim`, is raytrain.data.transforms')."""
    module, _, name = spec.rpartition(":") if ":" in spec else ("raytrain.data.transforms", ":", spec)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"data.transform {spec}: cannot import it ({first_line(e)}); give module:function of an "
                        f"importable module on every node, or a built-in: fim") from None
    if not callable(fn):
        raise UserError(f"data.transform {spec} is not a function")
    return fn


def check(data_cfg, split, seed: int, first_unit_rows: Callable[[], np.ndarray]) -> Optional[Transform]:
    """The run's transform, tried on the split's first unit: a one-line UserError before any worker starts if it
    cannot be imported, raises, or returns rows of another shape."""
    if not data_cfg.transform:
        return None
    t = Transform(data_cfg.transform, data_cfg.transform_args, seed)
    t(first_unit_rows(), epoch=0, unit=0, split=split)
    return t


@functools.lru_cache(maxsize=8)
def _token_ids(tokenizer_uri: str, names: tuple[str, ...]) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    from raytrain import storage

    tok = Tokenizer.from_str(storage.read_text(tokenizer_uri))
    ids = tuple(tok.token_to_id(n) for n in names)
    missing = [n for n, i in zip(names, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)}; prepare with special_tokens={list(names)}")
    return ids


def fim(rows: np.ndarray, *, rng: np.random.Generator, split, rate: float = 0.5, spm_rate: float = 0.5,
        sentinels: tuple = FIM_SENTINELS, ids: Optional[tuple] = None) -> np.ndarray:
    """Fill-in-the-middle (Bavarian et al. 2022; StarCoder, Code Llama): each row, with probability `rate`, becomes
    prefix / suffix / middle around two random cuts, in PSM order (<fim_prefix> prefix <fim_suffix> suffix
    <fim_middle> middle) or, with probability spm_rate among those, SPM (<fim_prefix> <fim_suffix> suffix
    <fim_middle> prefix middle). The row keeps its length: its last 3 tokens make room for the sentinels. Text rows
    only (every token is learned, so the loss needs no mask change); the sentinels must be in the tokenizer
    (`raytrain prepare special_tokens=[<fim_prefix>,<fim_middle>,<fim_suffix>]`), or their ids given as `ids`."""
    width = split.seq_len + 1
    if rows.shape[1] != width:
        raise ValueError("fim takes text rows (prepare format=text), not fine-tuning examples")
    pre, mid, suf = ids if ids is not None else _token_ids(split.tokenizer_uri, tuple(sentinels))
    out = rows.copy()
    n = width - 3
    chosen = rng.random(len(rows)) < rate
    spm = rng.random(len(rows)) < spm_rate
    cuts = np.sort(rng.integers(0, n + 1, size=(len(rows), 2)), axis=1)
    for r in np.flatnonzero(chosen):
        body = rows[r, :n]
        i, j = cuts[r]
        p, m, s = body[:i], body[i:j], body[j:]
        if spm[r]:
            out[r] = np.concatenate([[pre, suf], s, [mid], p, m])
        else:
            out[r] = np.concatenate([[pre], p, [suf], s, [mid], m])
    return out
