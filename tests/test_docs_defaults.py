"""Docs that match the code: the defaults that docs/*.md name for config keys equal raytrain.config's.

Only statements this test can read without guessing are checked, in two forms (Markdown emphasis and line breaks
allowed between the parts):
- `` `section.key: value` (default) `` or `` (the default) `` (also `key=value`);
- `` `section.key` (default `value`) `` or `` (default value) `` / `` (default: value) `` / `` defaults to value ``,
  the value one backticked token or one plain literal (a number, true / false, null).
A key that is not a field of raytrain.config.Config (a DeepSpeed or Tune setting) is skipped. docs/CONFIG.md is
generated from the models themselves and is not read.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raytrain.config import Config

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEY = r"`(?P<key>[a-z_]+(?:\.[a-z0-9_]+)+)"
LITERAL = r"[-+]?\d[\d_.]*(?:e[-+]?\d+)?|true|false|null"
STATEMENTS = (
    re.compile(KEY + r"\s*[:=]\s*(?P<value>[^`\s]+)`[*_]*\s*\((?:the\s+)?default\)"),
    re.compile(KEY + r"`[*_]*\s*(?:\(default:?|defaults\s+to)\s+(?:`(?P<value>[^`]+)`|(?P<literal>" + LITERAL
               + r"))(?=[\s,;)]|\.\s)", re.IGNORECASE),
)
UNSET = object()


def _default(key: str):
    """The default of a dotted key in raytrain.config's models; UNSET when it is not one of their fields."""
    model: type[BaseModel] = Config
    *sections, name = key.split(".")
    for s in sections:
        f = model.model_fields.get(s)
        if f is None or not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return UNSET
        model = f.annotation
    f = model.model_fields.get(name)
    if f is None:
        return UNSET
    return f.default_factory() if f.default is PydanticUndefined else f.default


def _equal(doc: str, default) -> bool:
    doc = doc.strip().strip("'\"")
    if isinstance(default, bool):
        return doc.lower() in (("true", "on") if default else ("false", "off"))
    if default is None:
        return doc.lower() in ("null", "none")
    if isinstance(default, (int, float)):
        try:
            return float(doc.replace("_", "")) == float(default)
        except ValueError:
            return False
    return doc == str(default)


def statements() -> list[tuple[str, str, str]]:
    """(file, key, value) for every default statement about a Config field in docs/*.md."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        if path.name == "CONFIG.md":
            continue
        text = path.read_text()
        for pattern in STATEMENTS:
            for m in pattern.finditer(text):
                value = m.group("value") if m.group("value") is not None else m.group("literal")
                if _default(m.group("key")) is not UNSET:
                    found.append((path.name, m.group("key"), value))
    return found


def test_the_defaults_named_in_the_docs_are_the_configs():
    found = statements()
    assert ("DATA.md", "data.reader", "auto") in found, found  # the statement issue 55 found wrong
    wrong = [f"docs/{f}: `{k}` default {v!r}, but raytrain.config's is {_default(k)!r}" for f, k, v in found
             if not _equal(v, _default(k))]
    assert not wrong, "\n".join(wrong)


def test_the_reader_finds_each_form_and_a_wrong_default():
    assert _default("data.reader") == "auto" and _default("data.nope") is UNSET and _default("zero.stage") is UNSET
    text = ("`data.reader: direct`** (default): ... `checkpoint.memory_dir` (default `/dev/shm`, tmpfs) ... "
            "`data.document_mask` (default\ntrue) ... `optim.lr` (default: the recipe's) ... "
            "`optim.lr` defaults to 3e-4; ")
    got = [(m.group("key"), m.group("value") or m.group("literal")) for p in STATEMENTS for m in p.finditer(text)]
    assert got == [("data.reader", "direct"), ("checkpoint.memory_dir", "/dev/shm"), ("data.document_mask", "true"),
                   ("optim.lr", "3e-4")]
    assert not _equal("direct", _default("data.reader")) and _equal("true", True) and _equal("1", 1)
