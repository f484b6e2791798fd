"""The roles table of docs/ACCESS.md covers every `raytrain` command (each action of those that take one) and every
serving endpoint, with the roles it defines and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "ACCESS.md"


def _table(title: str) -> dict[str, list[str]]:
    """{first cell: the roles cell split} of the table under heading `title`."""
    text = DOC.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|")[1:-1] for r in text.splitlines() if r.startswith("|")][2:]  # (the header, its rule)
    return {re.sub(r"`", "", r[0]).strip(): [x.strip() for x in r[1].split(",")] for r in rows}


def test_every_command_and_action_has_its_roles():
    from raytrain.cli import COMMANDS, build_parser

    roles = set(_table("Roles")) | {"anyone"}
    assert roles == {"data engineer", "trainer", "release manager", "auditor", "inference client", "operator", "anyone"}
    commands = _table("Commands")
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    want = set()
    for name in COMMANDS:
        action = next((a for a in sub[name]._actions if a.dest == "action"), None)
        choices = action.choices if action is not None and action.choices else None
        if name == "serve":
            from raytrain.commands.serve import ACTIONS

            choices = ACTIONS
        want |= {f"raytrain {name} {c}" for c in choices} if choices else {f"raytrain {name}"}
    assert set(commands) == want, (sorted(want - set(commands)), sorted(set(commands) - want))
    bad = {c: r for c, r in commands.items() if not r or set(r) - roles}
    assert not bad, bad


def test_every_serving_endpoint_has_its_roles():
    from raytrain.serving.app import ADMIN_EVENTS, ENDPOINTS

    endpoints = _table("Serving endpoints")
    paths = {e.split()[1] for e in endpoints}
    assert paths == set(ENDPOINTS) | set(ADMIN_EVENTS), paths ^ (set(ENDPOINTS) | set(ADMIN_EVENTS))
    assert endpoints["GET /healthz"] == ["anyone (load balancers)"]
    assert all(r == ["inference client"] for e, r in endpoints.items() if e.split()[1] in ENDPOINTS[:-1])
    assert all(r == ["release manager"] for e, r in endpoints.items() if e.split()[1].startswith("/admin/"))
