"""Code that reads easily, held: calls by name (the project's functions take at most three positional arguments and
never a positional bool, its dataclasses of more than three fields or any bool field are built by keyword; Python
then holds every call), short docstrings (the reasoning and the figures are in docs/), no code file over 450 lines."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

SOURCES = sorted(
    path
    for folder in ("bench", "common", "model", "pipeline", "studies", "trainer", "tools")
    for path in (REPO / folder).rglob("*.py")
) + [REPO / "ds_train.py"]
MAX_POSITIONAL = 3
MAX_DOC_LINES = {"module": 12, "definition": 6}  # a summary and a short paragraph (a module's usage lines too)
MAX_LINES = 450
MAX_TRAINER_LINES = 350


def _is_bool(annotation: ast.expr | None) -> bool:
    return (isinstance(annotation, ast.Name) and annotation.id == "bool") or (
        isinstance(annotation, ast.Constant) and annotation.value == "bool"
    )


def _dataclass_decorator(node: ast.ClassDef) -> ast.expr | None:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        ):
            return decorator
    return None


def _problems(path, root=REPO) -> list[str]:
    found = []
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            if positional and positional[0].arg in ("self", "cls"):
                positional = positional[1:]
            if len(positional) > MAX_POSITIONAL:
                found.append(f"{where}:{node.lineno} {node.name}: {len(positional)} positional parameters")
            found += [
                f"{where}:{node.lineno} {node.name}: positional bool {a.arg}"
                for a in positional
                if _is_bool(a.annotation)
            ]
        if isinstance(node, ast.ClassDef) and (decorator := _dataclass_decorator(node)) is not None:
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            keyword_only = isinstance(decorator, ast.Call) and any(
                k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value for k in decorator.keywords
            )
            if not keyword_only and (len(fields) > MAX_POSITIONAL or any(_is_bool(f.annotation) for f in fields)):
                found.append(f"{where}:{node.lineno} {node.name}: a dataclass built by position")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_the_projects_calls_read_by_name(path):
    assert _problems(path) == []


def test_the_rule_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from dataclasses import dataclass\n"
        "def four(a, b, c, d): ...\n"
        "def flag(a, on: bool): ...\n"
        "def fine(self, a, b, c, *, d, on: bool): ...\n"
        "@dataclass\nclass Wide:\n    a: int\n    b: int\n    c: int\n    d: int\n"
        "@dataclass(kw_only=True)\nclass Named:\n    a: int\n    b: int\n    c: int\n    d: bool\n"
    )
    assert [line.split(" ", 1)[1] for line in _problems(bad, root=tmp_path)] == [
        "four: 4 positional parameters",
        "flag: positional bool on",
        "Wide: a dataclass built by position",
    ]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_docstrings_are_a_summary_and_a_short_paragraph(path):
    tree = ast.parse(path.read_text())
    long = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node) or ""
        limit = MAX_DOC_LINES["module" if isinstance(node, ast.Module) else "definition"]
        if len(doc.splitlines()) > limit:
            long.append(f"{getattr(node, 'name', 'the module')}: {len(doc.splitlines())} lines")
    assert long == []


def test_no_code_file_is_long():
    """Modules split by what they do, never grown into one: the trainer's loop in a screen or two."""
    long = {p.relative_to(REPO).as_posix(): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    assert len((REPO / "trainer" / "trainer.py").read_text().splitlines()) <= MAX_TRAINER_LINES
