"""README's module table (*Design*) names every module of the library, once.

The table is where a reader looks for which module holds a call (its job,
and what it knows nothing of); a module split off without a row (or a row
left behind for a module gone) sends them to the wrong file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _table_rows(readme: str) -> list[str]:
    return re.findall(r"^\| `(asyncpool/[a-z_]+\.py)` \|", readme, flags=re.MULTILINE)


def test_the_readme_module_table_lists_every_module_once() -> None:
    rows = _table_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    modules = sorted(
        f"asyncpool/{path.name}"
        for path in (ROOT / "asyncpool").glob("*.py")
        if path.name != "__init__.py"
    )
    assert len(rows) == len(set(rows)), (
        f"listed twice: {sorted(r for r in rows if rows.count(r) > 1)}"
    )
    assert sorted(rows) == modules, (
        f"missing from README's table: {sorted(set(modules) - set(rows))}; "
        f"listed but gone: {sorted(set(rows) - set(modules))}"
    )


def test_the_check_reads_a_table_row() -> None:
    row = "| `asyncpool/pool.py` | `AsyncReqToTokenPool` | how the demo schedules |\n"
    assert _table_rows("intro\n" + row + "| `scheduler_demo/` | demo | |\n") == [
        "asyncpool/pool.py"
    ]
