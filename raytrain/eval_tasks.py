"""lm-evaluation-harness tasks: the harness itself (an optional extra), offline task loading, task-name checks."""

from __future__ import annotations

import difflib
import os
from typing import Optional

from raytrain.errors import UserError

INSTALL = "pip install 'raytrain[eval]'"


def harness():
    """The lm_eval module, or one line saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"downstream evaluation needs the lm-evaluation-harness: {INSTALL}") from None
    return lm_eval


def offline() -> None:
    # Task data comes from local files (include_path) or the HF cache; never a download from inside a run.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def task_manager(include_path: Optional[str], tasks: list[str]):
    """The harness's TaskManager; the user's task directory alone when it holds every task asked for (indexing the
    harness's ~15k built-in tasks takes seconds)."""
    harness()
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not os.path.isdir(include_path):
            raise UserError(f"eval.include_path {include_path} is not a directory of task YAMLs; "
                            "point it at the folder that holds your task files")
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], include_path: Optional[str]) -> None:
    """Every task name known to the harness (or the user's include_path), else one line with the near matches."""
    if not tasks:
        return
    known = task_manager(include_path, tasks).all_tasks
    for t in tasks:
        if t not in known:
            near = difflib.get_close_matches(t, known, n=5, cutoff=0.6)
            raise UserError(f"unknown evaluation task {t!r}" + (f"; did you mean {', '.join(near)}?" if near else
                            "; `lm-eval ls tasks` lists the harness's tasks, eval.include_path adds your own"))
