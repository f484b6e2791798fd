"""Where documents come from: local text / JSONL files and globs, or the built-in offline corpus.

The built-in `python-docs` corpus is real English technical prose that ships with every Python
installation (the pydoc topic pages plus the standard library's docstrings), so the demo and the
tests need no network and no downloads.
"""

from __future__ import annotations

import ast
import glob
import json
import sysconfig
from pathlib import Path
from typing import Iterator

from raytrain.errors import UserError

BUILTIN = {"python-docs"}


def _python_docs(max_chars: int) -> Iterator[str]:
    import pydoc_data.topics as topics

    total = 0
    for name in sorted(topics.topics):
        # Topic pages are long; split them on blank-line paragraphs into document-sized pieces so
        # the train / val split by document has enough documents to draw from.
        for doc in _chunks(topics.topics[name], 2000):
            total += len(doc)
            yield doc
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        if total >= max_chars:
            return
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    total += len(doc)
                    yield doc


def _chunks(text: str, target: int) -> Iterator[str]:
    buf: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        buf.append(para)
        size += len(para)
        if size >= target:
            yield "\n\n".join(buf)
            buf, size = [], 0
    if buf:
        yield "\n\n".join(buf)


def _expand(spec: str) -> list[Path]:
    if "://" in spec:
        raise UserError(f"input {spec!r}: prepare reads local files for now; copy the corpus locally first")
    paths = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
    files = []
    for p in paths:
        files.extend(sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p])
    if not files:
        raise UserError(f"input {spec!r} matches no files")
    return files


def iter_documents(inputs: list[str], text_field: str = "text", max_chars: int = 3_000_000) -> Iterator[str]:
    """Yield raw documents in a deterministic order (inputs in order, files sorted)."""
    for spec in inputs:
        if spec in BUILTIN:
            yield from _python_docs(max_chars)
            continue
        for path in _expand(spec):
            if path.suffix == ".jsonl":
                with open(path, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            rec = json.loads(line)
                        except json.JSONDecodeError:
                            raise UserError(f"{path}:{lineno}: not valid JSON") from None
                        if not isinstance(rec, dict) or text_field not in rec:
                            raise UserError(f"{path}:{lineno}: record has no {text_field!r} field (set text_field=...)")
                        yield str(rec[text_field])
            else:
                try:
                    yield path.read_text(encoding="utf-8", errors="replace")
                except OSError as e:
                    raise UserError(f"cannot read {path}: {e.strerror}") from None
