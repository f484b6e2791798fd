"""The built-in offline corpus `python-docs` (file inputs are read by data/inputs.py).

The built-in `python-docs` corpus is real English technical prose that ships with every Python
installation (the pydoc topic pages plus the standard library's docstrings), so the demo and the
tests need no network and no downloads.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from typing import Iterator

BUILTIN = {"python-docs"}


def python_docs(max_chars: int) -> Iterator[str]:
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
