"""Packaging (issue 14): the distribution installs only ``asyncpool`` and
``scheduler_demo``; ``benchmarks`` runs from a checkout and writes only under
the current directory or a path the user gave."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a source distribution would hold; never build in the checkout itself
# (setuptools leaves build/ and *.egg-info/ behind).
_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "out",
)


def _build(tmp_path: Path, hook: str) -> Path:
    """Run setuptools' PEP 517 ``hook`` (``build_wheel``, ``build_sdist``)
    on a copy of the checkout, offline, in a child process so its state
    stays out of this one (what `pip wheel . --no-build-isolation` calls);
    the folder it wrote into."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE)
    dist = tmp_path / "dist"
    dist.mkdir()
    code = f"import sys; from setuptools import build_meta; print(build_meta.{hook}(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(dist)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dist


def _build_wheel(tmp_path: Path) -> Path:
    dist = _build(tmp_path, "build_wheel")
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_holds_only_asyncpool_and_scheduler_demo(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {name.split("/", 1)[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1, tops
    assert tops - dist_info == {"asyncpool", "scheduler_demo"}, tops
    assert "asyncpool/__init__.py" in names and "asyncpool/py.typed" in names
    assert "scheduler_demo/__main__.py" in names
    # No benchmarks, examples, tests or docs at any depth.
    for bad in ("benchmarks", "examples", "tests", "docs"):
        assert not any(f"/{bad}/" in f"/{name}" for name in names), bad


def test_sdist_carries_the_whole_test_suite(tmp_path: Path) -> None:
    """The sdist's tests run from it: setuptools' default took
    tests/test_*.py alone, without conftest.py and helpers.py, so not one
    of them could be collected from an unpacked sdist. MANIFEST.in grafts
    the suite and what it reads (docs, examples, benchmarks, scripts)."""
    import tarfile

    dist = _build(tmp_path, "build_sdist")
    src = tmp_path / "src"
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {name.split("/", 1)[1] for name in tf.getnames() if "/" in name}
    wanted = {
        p.relative_to(src).as_posix()
        for top in ("tests", "benchmarks", "examples", "docs", "scripts")
        for p in (src / top).rglob("*")
        if p.is_file()
    }
    assert {"tests/conftest.py", "tests/helpers.py", "LICENSE", ".ci/run"} <= names
    assert sorted(wanted - names) == []


def test_benchmarks_default_markdown_path_is_under_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.run import DEFAULT_MD, main

    assert not DEFAULT_MD.is_absolute()
    repo_md = REPO / "docs" / "benchmarks.md"
    before = repo_md.stat().st_mtime_ns if repo_md.exists() else None
    monkeypatch.chdir(tmp_path)
    argv = ["--preset", "smoke", "--only", "uncontended", "--loops", "asyncio", "--clock", "cpu"]
    # A subset writes no report unless asked where (it would overwrite the
    # full one with a partial one)...
    assert main(argv) == 0
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    # ... and the default path, given, is relative: under the cwd.
    assert main([*argv, "--md", str(DEFAULT_MD)]) == 0
    capsys.readouterr()
    assert (tmp_path / "docs" / "benchmarks.md").is_file()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "docs",
        "docs/benchmarks.md",
    ]
    after = repo_md.stat().st_mtime_ns if repo_md.exists() else None
    assert after == before  # the checkout's own report is untouched


def test_benchmarks_from_json_of_a_subset_never_overwrites_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--from-json`` writes docs/benchmarks.md by default only for a saved
    run of every benchmark: re-rendering a subset's run (``--only``) must not
    replace the full report with a partial one, as the run itself does not."""
    import json

    from benchmarks.run import BENCHMARKS, DEFAULT_MD, main

    saved = tmp_path / "saved"
    saved.mkdir()
    js = saved / "subset.json"
    argv = ["--preset", "smoke", "--only", "uncontended", "--loops", "asyncio", "--clock", "cpu"]
    assert main([*argv, "--json", str(js)]) == 0
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["benchmarks"] == ["uncontended"]
    # The JSON's argv is the run's, as its command and the markdown say.
    assert data["argv"][1:] == [*argv, "--json", str(js)]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["--from-json", str(js)]) == 0
    capsys.readouterr()
    assert list(work.iterdir()) == []
    # A file saved before the "benchmarks" key: its command says --only.
    del data["benchmarks"]
    old = saved / "old.json"
    old.write_text(json.dumps(data), encoding="utf-8")
    assert main(["--from-json", str(old)]) == 0
    capsys.readouterr()
    assert list(work.iterdir()) == []
    # Asked where, it writes there; a saved run of every benchmark goes to the default.
    assert main(["--from-json", str(js), "--md", "subset.md"]) == 0
    data["benchmarks"] = list(BENCHMARKS)
    full = saved / "full.json"
    full.write_text(json.dumps(data), encoding="utf-8")
    assert main(["--from-json", str(full)]) == 0
    capsys.readouterr()
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == [
        "docs",
        DEFAULT_MD.as_posix(),
        "subset.md",
    ]
