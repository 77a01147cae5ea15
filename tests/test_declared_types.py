"""Every public attribute of the library has a declared type.

``pyright --verifytypes asyncpool --ignoreexternal`` reads 100%: it counts
a public name typed only by inference as ambiguous (``self.count = 0``,
bumped later; ``logger = getLogger(...)``), and every submodule is public
to it. pyright needs node from the network, so it is not run here; this
reads the source instead, with a stricter rule than pyright's (an
attribute set from an annotated parameter needs a declaration too: mypy
and pyright narrow such an assignment differently).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "asyncpool"


def _self_attr(node: ast.expr) -> str | None:
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _undeclared(tree: ast.Module, module: str) -> list[str]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            # Public lower-case module names; UPPER_CASE constants and
            # CapWords type aliases are read as what they are.
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id[:1].islower():
                    found.append(f"{module}.{target.id} (line {node.lineno})")
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        declared = set()
        assigned: dict[str, int] = {}
        for sub in ast.walk(node):
            if isinstance(sub, ast.AnnAssign):
                if isinstance(sub.target, ast.Name):
                    declared.add(sub.target.id)
                elif (name := _self_attr(sub.target)) is not None:
                    declared.add(name)
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    targets.extend(target.elts if isinstance(target, ast.Tuple) else [target])
            elif isinstance(sub, ast.AugAssign):
                targets.append(sub.target)
            for target in targets:
                name = _self_attr(target)
                if name is not None and not name.startswith("_"):
                    assigned.setdefault(name, sub.lineno)
        found += [
            f"{module}.{node.name}.{name} (line {line})"
            for name, line in sorted(assigned.items())
            if name not in declared
        ]
    return found


def test_public_attributes_are_declared() -> None:
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        found += _undeclared(ast.parse(path.read_text(encoding="utf-8")), path.stem)
    assert not found, "public attributes without a declared type: " + ", ".join(found)


def test_the_check_sees_an_undeclared_attribute() -> None:
    source = (
        "logger = make()\n"
        "class Pool:\n"
        "    size: int\n"
        "    def __init__(self) -> None:\n"
        "        self.size = 1\n"
        "        self.count = 0\n"
        "        self._hidden = 0\n"
        "        self.typed: int = 0\n"
        "    def bump(self) -> None:\n"
        "        self.count += 1\n"
        "        self.typed += 1\n"
        "        self.later = 2\n"
        "class _Private:\n"
        "    def __init__(self) -> None:\n"
        "        self.free = 0\n"
    )
    assert _undeclared(ast.parse(source), "m") == [
        "m.logger (line 1)",
        "m.Pool.count (line 6)",
        "m.Pool.later (line 12)",
    ]
