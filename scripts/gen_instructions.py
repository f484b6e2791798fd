"""An instruction set from what ships with Python, for the fine-tuning recipe (docs/LIFECYCLE.md, "Instruction and chat fine-tuning").

Each example: the prompt is a public function's module and signature, the completion the first paragraph of its
docstring. Whole modules are held out (every 5th module by name hash), so held-out loss measures generalisation
to unseen modules. Writes <out>/train.jsonl and <out>/heldout.jsonl (prompt / completion records).
Usage: python scripts/gen_instructions.py --out data/instructions
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import pkgutil
import sys
import warnings

SKIP = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "test", "lib2to3", "ensurepip", "venv"}


def examples(max_chars: int = 400):
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names
                   and not m.name.startswith("_") and m.name not in SKIP)
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform-specific modules
            continue
        for fname, fn in sorted(vars(mod).items()):
            if fname.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != name:
                continue
            doc = inspect.getdoc(fn)
            if not doc:
                continue
            para = doc.split("\n\n", 1)[0].strip()
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if 10 <= len(para) <= max_chars:
                yield name, {"prompt": f"# {name}\ndef {fname}{sig}:\n    \"\"\"", "completion": para + '"""'}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/instructions")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n = {"train": 0, "heldout": 0}
    with open(os.path.join(args.out, "train.jsonl"), "w") as tr, open(os.path.join(args.out, "heldout.jsonl"), "w") as ho:
        for module, rec in examples():
            held = hashlib.sha256(module.encode()).digest()[0] % 5 == 0
            (ho if held else tr).write(json.dumps(rec) + "\n")
            n["heldout" if held else "train"] += 1
    print(f"{n['train']} train and {n['heldout']} held-out examples in {args.out}")


if __name__ == "__main__":
    main()
