"""Run line mutants of asyncpool against the CUDA tests, many at once, on a GPU machine.

The CPU suite cannot kill a mutant on a line only CUDA runs; this runs such
mutants (made by ``--make`` from a coverage file of the CPU suite) against
the tests marked ``cuda``. Each worker owns a copy of the checkout, applies
one mutant at a time, runs ``pytest -x -m cuda`` on the CUDA test files and
restores the file. The unmutated checkout runs alongside as a control: a
control that fails means the figures are noise, not kills.

    # on a CPU machine: which lines does the CPU suite never run?
    pip install coverage
    COVERAGE_FILE=/tmp/cov python -m coverage run --source=asyncpool -m pytest -q tests
    python scripts/cuda_mutation_sweep.py --make /tmp/cov mutants.json
    # on the GPU machine, from the checkout:
    python scripts/cuda_mutation_sweep.py --run mutants.json --out results.json \
        --workers 12 --deadline 400

A mutant is a one-line edit: a statement deleted (``pass``), a ``return``
of ``None``, a condition negated, an operator, boolean or number swapped.
Results: ``killed`` (a test failed), ``timeout`` (it hung: killed too),
``survived`` (every CUDA test passed: a gap, or a line the CPU suite runs in
a subprocess that coverage did not see), ``skipped`` (past the deadline),
``error`` (it did not import: a swap that is not Python, such as ``for x
not in``). The controls are reported apart; if one failed, a kill by the
test it failed proves nothing. A killed mutant keeps its first failing
test's line, the rest their output's tail.
Not a test and not run by CI.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CUDA_TEST_FILES = [
    "tests/test_cuda.py",
    "tests/test_fences.py",
    "tests/test_kv_pages.py",
    "tests/test_tables.py",
    "tests/test_async_pool.py",
    "tests/test_explicit.py",
    "tests/test_watcher_slow_fences.py",
    "tests/test_mutation_sweep_tables.py",
    "tests/test_demo.py",
]
SWAPS = {
    "==": "!=", "!=": "==", "<": "<=", "<=": "<", ">": ">=", ">=": ">",
    "and": "or", "or": "and", "True": "False", "False": "True",
    "+": "-", "-": "+", "is": "is not", "in": "not in", "None": "0",
}  # fmt: skip
_BLOCKS = (
    ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef,
    ast.AsyncFunctionDef, ast.ClassDef, ast.AsyncWith, ast.AsyncFor,
)  # fmt: skip
_NOT_DELETED = (ast.Pass, ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom)


def _line_mutants(text: str, stmt: ast.stmt | None, head: ast.stmt | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    indent = text[: len(text) - len(text.lstrip())]
    if stmt is not None and stmt.end_lineno == stmt.lineno and not isinstance(stmt, _NOT_DELETED):
        if isinstance(stmt, ast.Return) and stmt.value is not None:
            out.append((f"{indent}return None\n", "return None"))
        else:
            out.append((f"{indent}pass\n", "delete"))
    if isinstance(head, (ast.If, ast.While)) and head.test.end_lineno == head.lineno:
        m = re.match(r"(\s*)(if|elif|while) (.*):(\s*#.*)?\n$", text)
        if m:
            out.append((f"{m.group(1)}{m.group(2)} not ({m.group(3)}):\n", "negate"))
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        toks = []
    for t in toks:
        if t.start[0] != 1 or t.type in (tokenize.COMMENT, tokenize.STRING):
            continue
        s, (c0, c1) = t.string, (t.start[1], t.end[1])
        if t.type in (tokenize.OP, tokenize.NAME) and s in SWAPS:
            out.append((text[:c0] + SWAPS[s] + text[c1:], f"{s} -> {SWAPS[s]}"))
        elif t.type == tokenize.NUMBER and s.isdigit():
            out.append((text[:c0] + str(int(s) + 1) + text[c1:], f"{s} -> {int(s) + 1}"))
        elif t.type == tokenize.NAME and s == "not":
            out.append((text[:c0] + text[c1:].lstrip(" "), "not dropped"))
    seen: set[str] = set()
    return [(new, kind) for new, kind in out if new != text and not (new in seen or seen.add(new))]


def make(coverage_file: str, out: str) -> None:
    import coverage

    cov = coverage.Coverage(data_file=coverage_file)
    cov.load()
    mutants: list[dict[str, Any]] = []
    for path in sorted((ROOT / "asyncpool").glob("*.py")):
        missing = set(cov.analysis2(str(path))[3])
        if not missing:
            continue
        src = path.read_text()
        lines = src.splitlines(keepends=True)
        stmts: dict[int, ast.stmt] = {}
        heads: dict[int, ast.stmt] = {}
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.stmt):
                (heads if isinstance(node, _BLOCKS) else stmts).setdefault(node.lineno, node)
        for ln in sorted(missing):
            for new, kind in _line_mutants(lines[ln - 1], stmts.get(ln), heads.get(ln)):
                mutants.append(
                    {"id": len(mutants), "file": str(path.relative_to(ROOT)), "line": ln,
                     "old": lines[ln - 1], "new": new, "kind": kind}
                )  # fmt: skip
    Path(out).write_text(json.dumps(mutants, indent=1))
    print(f"{len(mutants)} mutants on {len({m['file'] for m in mutants})} files -> {out}")


def run(mutants_file: str, out: str, workers: int, deadline_s: float, per_mutant_s: float) -> None:
    mutants = json.loads(Path(mutants_file).read_text())
    controls = [{"id": -i, "control": True} for i in range(1, 3)]
    jobs = controls[:1] + mutants + controls[1:]
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    copies: list[Path] = []
    base = Path(tempfile.mkdtemp(prefix="cuda-mutants-"))
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".venv")
    for k in range(workers):
        dst = base / f"w{k}"
        shutil.copytree(ROOT, dst, ignore=ignore)
        copies.append(dst)
    free_copies = list(copies)

    def one(job: dict[str, Any]) -> dict[str, Any]:
        if time.monotonic() - t0 > deadline_s:
            return {**job, "result": "skipped"}
        with lock:
            copy = free_copies.pop()
        target = copy / job["file"] if "file" in job else None
        original = target.read_text() if target else ""
        try:
            if target:
                lines = original.splitlines(keepends=True)
                assert lines[job["line"] - 1] == job["old"], (job["id"], "stale mutant")
                lines[job["line"] - 1] = job["new"]
                target.write_text("".join(lines))
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]),
            }
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   "-m", "cuda", "--timeout", "60", *CUDA_TEST_FILES]  # fmt: skip
            s = time.monotonic()
            # A session of its own: a hung run's children (subprocess tests) die with it.
            proc = subprocess.Popen(
                cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, start_new_session=True,
            )  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=per_mutant_s)
                rc: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                rc = "timeout"
            tail = (out or "")[-1500:]
            if "file" not in job:  # the unmutated control
                result = "control passed" if rc == 0 else f"control FAILED (rc={rc})"
            else:
                named = {0: "survived", 1: "killed", "timeout": "timeout"}
                result = named.get(rc, f"error rc={rc}")
            return {**job, "result": result, "seconds": round(time.monotonic() - s, 1),
                    "tail": tail if result != "killed" else _first_failure(tail)}  # fmt: skip
        finally:
            if target:
                target.write_text(original)
            with lock:
                free_copies.append(copy)

    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        for fut in concurrent.futures.as_completed([ex.submit(one, j) for j in jobs]):
            r = fut.result()
            results.append(r)
            Path(out).write_text(json.dumps(results, indent=1))
            print(r["id"], r["result"], r.get("seconds"), flush=True)
    counts: dict[str, int] = {}
    for r in results:
        if "file" in r:  # the controls are reported on their own lines above
            counts[r["result"]] = counts.get(r["result"], 0) + 1
    shutil.rmtree(base, ignore_errors=True)
    print("totals", counts, f"in {time.monotonic() - t0:.0f}s")


def _first_failure(tail: str) -> str:
    hits = [ln for ln in tail.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return hits[0] if hits else tail[-300:]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--make", nargs=2, metavar=("COVERAGE_FILE", "OUT_JSON"))
    ap.add_argument("--run", metavar="MUTANTS_JSON")
    ap.add_argument("--out", default="cuda_mutants_results.json")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument(
        "--deadline", type=float, default=400.0, help="start no mutant after this many seconds"
    )
    ap.add_argument("--per-mutant", type=float, default=150.0)
    a = ap.parse_args()
    if a.make:
        make(*a.make)
    elif a.run:
        run(a.run, a.out, a.workers, a.deadline, a.per_mutant)
    else:
        ap.error("--make or --run")
