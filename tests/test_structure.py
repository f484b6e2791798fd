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
