"""The shape of the code, checked: short functions, keyword arguments, one owner per name (issue 24's rules)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raytrain"
ARGPARSE_TABLES = {"build_parser", "add_parser"}  # a table of options reads best as one block


def _modules(*roots: Path) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for r in roots for p in sorted(r.rglob("*.py"))}


@pytest.fixture(scope="module")
def package() -> dict[Path, ast.Module]:
    return _modules(PACKAGE)


def _strings(tree: ast.Module) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_function_over_80_lines(package):
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, t in package.items() for n in ast.walk(t)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name not in ARGPARSE_TABLES
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_no_constructor_takes_more_than_5_positional_arguments(package):
    classes = {n.name for t in package.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    calls = []
    for p, t in package.items():
        for n in ast.walk(t):
            if isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
                if name in classes and len(n.args) > 5:
                    calls.append(f"{p.relative_to(ROOT)}:{n.lineno} {name}({len(n.args)} positional)")
    assert not calls, calls


def test_no_private_name_is_imported_across_modules(package):
    found = [f"{p.relative_to(ROOT)}:{n.lineno} {n.module}.{a.name}"
             for p, t in package.items() for n in ast.walk(t)
             if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("raytrain")
             for a in n.names if a.name.startswith("_")]
    assert not found, found


def test_each_run_directory_file_is_named_in_one_module(package):
    """Every run-directory file name is a literal of raytrain/rundir.py only (prepared datasets, under
    raytrain/data/, have a layout of their own)."""
    from raytrain.rundir import FILES

    names = {n for n in FILES if "." in n}  # file names; directory names ("tags") are also ordinary words
    where: dict[str, set[str]] = {}
    for p, t in {**package, **_modules(ROOT / "scripts")}.items():
        if PACKAGE / "data" in p.parents:
            continue
        for s in _strings(t):
            for name in names:
                if s == name or s.endswith("/" + name):
                    where.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    assert all(w == {"raytrain/rundir.py"} for w in where.values()), where


def test_checkpoint_name_timestamp_format_and_file_hash_are_written_once(package):
    trees = {**package, **_modules(ROOT / "scripts")}
    code = {p: p.read_text() for p in trees}
    assert [p.name for p, s in code.items() if "checkpoint_{" in s] == ["layout.py"]
    assert [p.name for p, s in code.items() if "%Y-%m-%dT%H:%M:%S" in s] == ["layout.py"]
    assert [p.name for p, s in code.items() if "iter(lambda: f.read(" in s] == ["layout.py"]


def test_run_directory_doc_is_current():
    from raytrain.rundir import reference_markdown

    doc = ROOT / "docs" / "RUN_DIRECTORY.md"
    assert doc.read_text() == reference_markdown(), "regenerate: python -m raytrain.rundir > docs/RUN_DIRECTORY.md"


def test_architecture_layout_table_matches_the_tree():
    """Every path docs/ARCHITECTURE.md's Layout table names exists, and every module and package of raytrain/ is in
    it."""
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    named: set[Path] = set()
    for row in (r for r in text.splitlines() if r.startswith("| `")):
        cell = row.split("|")[1]
        paths = re.findall(r"`([^`]+)`", cell)
        first = ROOT / paths[0]
        base = first if first.is_dir() else first.parent  # where the row's other names are
        for i, path in enumerate(paths):
            p = ROOT / path if i == 0 or (ROOT / path).exists() else base / path
            assert p.exists(), f"docs/ARCHITECTURE.md's Layout names {path}, which is not in the tree"
            named.add(p.resolve())
        for sub in re.findall(r"`([a-z_]+\.py)`", row.split("|")[2]):  # modules named in the description
            if (base / sub).exists():
                named.add((base / sub).resolve())
    mine = [p for p in PACKAGE.iterdir() if (p.suffix == ".py" and p.name not in ("__init__.py", "__main__.py"))
            or (p.is_dir() and (p / "__init__.py").exists())]
    missing = [str(p.relative_to(ROOT)) for p in mine if p.resolve() not in named]
    assert not missing, f"docs/ARCHITECTURE.md's Layout does not mention {missing}"


def test_the_test_extra_holds_every_other_extra():
    # scripts/_env.sh takes a current test install for any extra's (finetune.sh asks for lora).
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    test = set(extras["test"])
    missing = {name: sorted(set(reqs) - test) for name, reqs in extras.items() if set(reqs) - test}
    assert not missing, f"add these to the test extra in pyproject.toml: {missing}"
