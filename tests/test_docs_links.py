"""What the user docs name exists: every relative link of README.md and docs/*.md, every repository file they name in
backticks, and every `raytrain` command they show parses (the CLI's own parser)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAMED = re.compile(r"`((?:scripts|cluster|raytrain|tests|docs|tune_configs)/[\w./-]+)`")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def _ids(paths):
    return [p.name for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_relative_link_and_named_file_exists(doc):
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    for name in NAMED.findall(text):
        name = name.rstrip(".")
        module = re.sub(r"\.\w+$", ".py", name)  # `tests/helpers.tiny_cfg`: a name in a module
        if not any(c in name for c in "<>*{}") and not (ROOT / name).exists() and not (ROOT / module).exists():
            missing.append(name)
    assert not missing, f"{doc.name} names what does not exist: {missing}"


def _commands(text: str) -> list[str]:
    """The `raytrain ...` lines of a doc's code blocks: continuation lines joined, comments and prompts dropped."""
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("raytrain "):
                out.append(re.split(r"\s+#\s", line, maxsplit=1)[0].strip())
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_raytrain_command_shown_parses(doc):
    from raytrain.cli import build_parser

    parser = build_parser()
    bad = []
    for cmd in _commands(doc.read_text()):
        if "..." in cmd or "|" in cmd:  # a pattern, not a command
            continue
        try:
            parser.parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            bad.append(cmd)
        except ValueError:  # shlex: unbalanced quotes in a shortened line
            bad.append(cmd)
    assert not bad, f"{doc.name} shows commands raytrain refuses: {bad}"
