"""Paper numbers live only in ``experiments/<paper>/paper.yaml`` and guessed or fitted constants only in
``assumptions.yaml``, and the code reads them from there: editing the YAML must move every figure that uses it.

Two walks over the package:
- every float literal in ``moelab/`` that equals a distinctive paper number (two or more significant digits, not a
  whole number; also as a percentage) is a copy of the paper typed into code;
- every assumption key must be read somewhere in ``moelab/`` (as the string naming it).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
PAPERS = ("fastermoe", "hecate", "lina", "lsh_moe", "parm")
SOURCES = sorted((ROOT / "moelab").rglob("*.py"))


def _significant_digits(v: float) -> int:
    digits = f"{abs(v):.12g}".replace(".", "").lstrip("0").rstrip("0")
    return len(digits.split("e")[0])


def distinctive(v, digits: int = 2) -> bool:
    """A value too particular to be a coincidence: not whole, and with at least ``digits`` significant digits."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) != int(v) \
        and _significant_digits(float(v)) >= digits


def paper_values(paper: str) -> dict:
    """distinctive value (and its percentage / fraction twin) -> the paper.yaml keys holding it."""
    data = yaml.safe_load((ROOT / "experiments" / paper / "paper.yaml").read_text()) or {}
    out: dict = {}
    for key, e in (data.get("numbers") or {}).items():
        v = e.get("value")
        if distinctive(v):
            for twin in (float(v), round(float(v) * 100, 9), round(float(v) / 100, 12)):
                if distinctive(twin):
                    out.setdefault(twin, []).append(key)
    return out


ALLOW = "# not a paper number"  # on a line whose literal equals a paper number by coincidence (say why)


NUMBER_IN_TEXT = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")


def float_literals(path: Path):
    """Float constants, and decimal numbers written inside strings (a note saying "the paper: 2.21x")."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or ALLOW in lines[node.lineno - 1]:
            continue
        if isinstance(node.value, float):
            yield node.lineno, node.value
        elif isinstance(node.value, str) and id(node) not in docstrings:
            for m in NUMBER_IN_TEXT.finditer(node.value):
                yield node.lineno, float(m.group())


def in_paper_package(path: Path, paper: str) -> bool:
    parts = path.relative_to(ROOT).parts
    return len(parts) > 2 and parts[1] in ("papers", "strategies") and parts[2] == paper


def sources_of(paper: str) -> list:
    """The core and this paper's own packages (another paper's code matching by coincidence is no copy)."""
    others = {o for o in PAPERS if o != paper}
    return [p for p in SOURCES if not (len(p.relative_to(ROOT).parts) > 2 and p.relative_to(ROOT).parts[1]
                                       in ("papers", "strategies") and p.relative_to(ROOT).parts[2] in others)]


@pytest.mark.parametrize("paper", PAPERS)
def test_no_paper_number_is_typed_in_code(paper):
    values = paper_values(paper)
    # the paper's own packages: two significant digits suffice; the core: three (0.25 or 1.2 is no copy there)
    hits = [f"{p.relative_to(ROOT)}:{line}: {v!r} is {values[v]} of experiments/{paper}/paper.yaml"
            for p in sources_of(paper) for line, v in float_literals(p)
            if v in values and distinctive(v, 2 if in_paper_package(p, paper) else 3)]
    assert not hits, "paper numbers typed in code (read them with paper_value):\n" + "\n".join(hits)


@pytest.mark.parametrize("paper", PAPERS)
def test_every_assumption_is_read(paper):
    data = yaml.safe_load((ROOT / "experiments" / paper / "assumptions.yaml").read_text()) or {}
    names, patterns = set(), []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            # a key counts as read where it is passed to a call or used as an index, not where a dict restates it
            if isinstance(node, ast.Call):
                names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                names.add(node.slice.value)
            elif isinstance(node, ast.JoinedStr) and sum(  # f"model.{name}.{field}" reads a family of keys
                    len(v.value) for v in node.values if isinstance(v, ast.Constant)) >= 3:
                patterns.append(re.compile("".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+"
                                                   for v in node.values) + "$"))
    unread = [k for k in (data.get("assumptions") or {})
              if k not in names and not any(r.match(k) for r in patterns)]
    assert not unread, f"experiments/{paper}/assumptions.yaml: nothing in moelab/ reads {unread}"


def test_the_walk_can_fail(tmp_path):
    """The literal walk finds a typed copy (and ignores round numbers), so a green run means something."""
    src = tmp_path / "m.py"
    src.write_text("A = 17.87\nB = 0.5\nC = 8.0\nD = 1.84  # not a paper number: a margin\n")
    assert [v for _, v in float_literals(src) if distinctive(v)] == [17.87]
