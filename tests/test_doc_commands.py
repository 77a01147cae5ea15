"""Every command line the documents show is one its program accepts.

README.md, the pages its depth moved to (docs/demo.md, docs/api.md,
docs/tp.md, docs/performance.md, docs/testing.md), docs/cuda.md and
docs/benchmarks.md name commands (``python -m
scheduler_demo --unsafe``) in shell blocks and in code spans that may wrap a
line, and flags (``--tp 1``, ``--evict-behind-write-fence``) in prose; the
demo's ``--help`` epilog and the docstrings of the demo's and the
benchmarks' modules name more. None of them runs in a test, so a flag
renamed or dropped would leave the documents wrong unseen.

Each ``python -m MODULE ARGS`` shown runs MODULE's ``main(ARGS)`` through
every check it makes before it starts working (its parser, then its own
checks: the demo's flag combinations and output paths, the benchmarks'
names and loop kinds), stopped where the run would begin. Each span that
starts with a flag names flags of the demo, its ``compare``, the
benchmarks' programs or the examples, and (placeholders aside) parses under
one of them. Hand-made edits of the documents (a flag renamed, a benchmark
name misspelt, a refused combination, a flag of no program) each fail here.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from helpers import PROSE_DOCS, load_example

import benchmarks
import benchmarks.ablation
import benchmarks.batch_calls
import benchmarks.grant_parts
import benchmarks.history
import benchmarks.profile
import benchmarks.run
import benchmarks.scrape_costs
import benchmarks.soak
import scheduler_demo
import scheduler_demo.cli
import scheduler_demo.compare

ROOT = Path(__file__).resolve().parent.parent
DOCS = (*PROSE_DOCS, "docs/cuda.md", "docs/benchmarks.md")
#: Modules whose docstrings show commands.
DOC_MODULES = (
    scheduler_demo,
    scheduler_demo.cli,
    scheduler_demo.compare,
    benchmarks,
    benchmarks.run,
    benchmarks.ablation,
    benchmarks.batch_calls,
    benchmarks.grant_parts,
    benchmarks.history,
    benchmarks.profile,
    benchmarks.scrape_costs,
    benchmarks.soak,
)
#: Modules the documents run that are not this project's programs.
NOT_OURS = {"pytest", "venv", "pip"}
EXAMPLES = (
    "overlap_step",
    "sync_dropin",
    "paged_admission",
    "speculative_decode",
    "hybrid_admission",
    "weight_update",
    "n_samples",
    "router_drain",
    "radix_cache",
    "preempt_retry",
    "lora_slots",
    "disagg_transfer",
    "hybrid_prefix",
    "disagg_decode",
    "pd_router",
)

_FENCED = re.compile(r"^```.*?^```", re.M | re.S)
_SPAN = re.compile(r"`([^`]+)`")
_RST_SPAN = re.compile(r"``(.+?)``", re.S)
_COMMAND = re.compile(r"python3? -m ([A-Za-z_][\w.]*)(.*)")
#: Where a command's arguments end in a shell line.
_END = re.compile(r"\s(?:&&|\||;|#)|$")
#: A placeholder the documents write for a value (PATH, N, NAME,...).
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(?:,\.\.\.)?$")


class Reached(Exception):
    """Raised where a program's run would start: every check passed."""


def _snippets(text: str) -> Iterator[str]:
    """A markdown text's shell-block lines and code spans (a span that
    wraps a line read as one line)."""
    for block in _FENCED.findall(text):
        for line in block.splitlines()[1:-1]:
            yield line.strip().removeprefix("$ ")
    for span in _SPAN.findall(_FENCED.sub("", text)):  # the spans of the prose
        yield " ".join(span.split())


def _prose(doc: str) -> str:
    """A document's text without its shell blocks."""
    return _FENCED.sub("", (ROOT / doc).read_text())


def _doc_snippets() -> Iterator[tuple[str, str]]:
    for doc in DOCS:
        for snippet in _snippets((ROOT / doc).read_text()):
            yield doc, snippet
    epilog = scheduler_demo.cli.build_parser().epilog or ""
    for line in epilog.splitlines():
        yield "scheduler_demo --help", line.strip()
    for mod in DOC_MODULES:
        for span in _RST_SPAN.findall(mod.__doc__ or ""):
            yield mod.__name__, " ".join(span.split())


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, arguments) of every ``python -m`` the documents show."""
    found = []
    for where, snippet in _doc_snippets():
        for match in _COMMAND.finditer(snippet):
            module, rest = match.group(1), match.group(2)
            end = _END.search(rest)
            assert end is not None
            found.append((where, module, shlex.split(rest[: end.start()])))
    return found


def flag_spans() -> list[tuple[str, str]]:
    """(where, span) of every code span of the documents that starts with a flag."""
    return [
        (doc, span)
        for doc in DOCS
        for span in (" ".join(s.split()) for s in _SPAN.findall(_prose(doc)))
        if re.match(r"--?[A-Za-z]", span)
    ]


COMMANDS = commands()
FLAG_SPANS = flag_spans()


def _capture_parser(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser ``main`` builds, taken at its ``parse_args`` (nothing runs)."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> NoReturn:
        seen.append(self)
        raise Reached

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(Reached):
            main([])
    return seen[0]


def _raise_reached(*args: object, **kwargs: object) -> NoReturn:
    raise Reached


def _stop_before_run(module: str, mp: pytest.MonkeyPatch) -> Callable[[list[str]], object]:
    """MODULE's main, with what starts its run replaced by :class:`Reached`."""
    if module == "scheduler_demo":
        mp.setattr(scheduler_demo.cli, "run_demo", _raise_reached)
        mp.setattr(scheduler_demo.cli, "_main_tp", _raise_reached)
        mp.setattr(logging, "basicConfig", lambda **kw: None)  # the test's logging stays
        return scheduler_demo.cli.main
    if module == "scheduler_demo.compare":
        check_args = scheduler_demo.cli.check_args  # what compare calls

        def checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> NoReturn:
            check_args(parser, args)
            raise Reached

        mp.setattr(scheduler_demo.compare, "check_args", checked)
        return scheduler_demo.compare.main
    if module == "benchmarks":
        mp.setattr(benchmarks.run, "_render_saved", _raise_reached)  # --from-json
        mp.setattr(benchmarks.run, "loadavg", _raise_reached)  # the first thing a run does
        return benchmarks.run.main
    if module == "benchmarks.ablation":
        mp.setattr(benchmarks.ablation, "run", _raise_reached)
        return benchmarks.ablation.main
    if module == "benchmarks.batch_calls":
        mp.setattr(benchmarks.batch_calls, "measure", _raise_reached)
        return benchmarks.batch_calls.main
    if module == "benchmarks.grant_parts":
        mp.setattr(benchmarks.grant_parts, "run_on", _raise_reached)
        return benchmarks.grant_parts.main
    if module == "benchmarks.history":
        mp.setattr(benchmarks.history, "render_history", _raise_reached)  # files read first
        return benchmarks.history.main
    if module == "benchmarks.scrape_costs":
        mp.setattr(benchmarks.scrape_costs, "run_on", _raise_reached)
        return benchmarks.scrape_costs.main
    if module == "benchmarks.profile":
        mp.setattr(benchmarks.profile, "profile", _raise_reached)
        return benchmarks.profile.main
    if module == "benchmarks.soak":
        mp.setattr(benchmarks.soak, "run_on", _raise_reached)
        return benchmarks.soak.main
    pytest.fail(f"the documents run `python -m {module}`, which this test does not know")


def _as_if_everything_installed(mp: pytest.MonkeyPatch) -> None:
    """The checks the demo makes of the machine (a CUDA device, matplotlib
    for ``--plot``) pass: a command is checked for what it says, not for
    this machine."""
    mp.setattr(torch.cuda, "is_available", lambda: True)
    if "matplotlib" not in sys.modules:
        try:
            import matplotlib  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        except ImportError:
            mp.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))


def check_command(module: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Fail unless MODULE's main accepts ARGS up to the start of its run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        _as_if_everything_installed(mp)
        main = _stop_before_run(module, mp)
        try:
            main(args)
        except Reached:
            return
        except SystemExit as exc:
            if exc.code == 0 and "--help" in args:
                return  # the help printed, as asked
            err = capsys.readouterr().err.strip().splitlines()
            pytest.fail(f"refused ({exc.code}): {err[-1] if err else exc}")
        pytest.fail("returned before its run started (a check refused it)")


def test_the_documents_show_commands_and_flags() -> None:
    """The extraction reads what it is meant to (it cannot pass on nothing):
    a command in a shell block, one wrapped across lines in a span, one from
    the demo's epilog and one from a docstring."""
    shown = {(module, shlex.join(args)) for _, module, args in COMMANDS}
    assert ("scheduler_demo", "--plot docs/demo_plot.png") in shown  # a shell block
    assert ("scheduler_demo", "--admission row-first") in shown  # a span across lines
    assert ("scheduler_demo.compare", "--rounds 3") in shown  # the epilog
    assert ("benchmarks.profile", "uncontended --loop uvloop") in shown  # a docstring
    assert len(COMMANDS) >= 30, len(COMMANDS)
    assert len({module for _, module, _ in COMMANDS} - NOT_OURS) == 10
    assert len(FLAG_SPANS) >= 30, len(FLAG_SPANS)


@pytest.mark.parametrize(
    ("module", "args"),
    sorted({(m, tuple(a)) for _, m, a in COMMANDS if m not in NOT_OURS}),
    ids=lambda v: v if isinstance(v, str) else shlex.join(v) or "(no arguments)",
)
def test_every_command_shown_passes_its_programs_checks(
    module: str, args: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    check_command(module, list(args), capsys)


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every program's parser, by what its command is called."""
    found = {
        "scheduler_demo": scheduler_demo.cli.build_parser(),
        "scheduler_demo.compare": scheduler_demo.compare.build_compare_parser(),
        "benchmarks": _capture_parser(benchmarks.run.main),
        "benchmarks.ablation": _capture_parser(benchmarks.ablation.main),
        "benchmarks.grant_parts": _capture_parser(benchmarks.grant_parts.main),
        "benchmarks.history": _capture_parser(benchmarks.history.main),
        "benchmarks.profile": _capture_parser(benchmarks.profile.main),
        "benchmarks.soak": _capture_parser(benchmarks.soak.main),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name in EXAMPLES:
            found[f"examples/{name}.py"] = _capture_parser(load_example(name, mp).main)
    return found


def _takes(parser: argparse.ArgumentParser, flag: str) -> bool:
    return any(flag in action.option_strings for action in parser._actions)


def _parses(parser: argparse.ArgumentParser, tokens: list[str]) -> bool:
    try:
        parser.parse_args(tokens)
    except SystemExit:
        return False
    return True


def _pytest_markers() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    return set(re.findall(r'^\s*"(\w+):', text, re.M))


@pytest.mark.parametrize(("where", "span"), FLAG_SPANS, ids=[s for _, s in FLAG_SPANS])
def test_every_flag_named_is_a_flag_of_a_program(
    where: str, span: str, parsers: dict[str, argparse.ArgumentParser], capsys: Any
) -> None:
    tokens = shlex.split(span)
    if tokens[0] == "-m":  # pytest's marker selection (`-m cuda`)
        assert len(tokens) == 2 and tokens[1] in _pytest_markers(), span
        return
    flags = [t for t in tokens if t.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", t)]
    unknown = [f for f in flags if not any(_takes(p, f) for p in parsers.values())]
    assert not unknown, f"{where}: `{span}` names {unknown}, a flag of no program"
    if len(tokens) == 1 or any(_PLACEHOLDER.match(t) for t in tokens):
        return  # a flag named, or a usage with placeholders: not a command line
    takers = [name for name, p in parsers.items() if all(_takes(p, f) for f in flags)]
    assert any(_parses(parsers[name], tokens) for name in takers), (
        f"{where}: `{span}` parses under none of {takers}"
    )
    if "benchmarks" in takers and _parses(parsers["benchmarks"], tokens):
        # Its names (--only, --loops) are checked by main, not by the parser.
        # (The demo's own checks refuse flags named alone that need others,
        # `--tp-reclaim auto`: spans are not command lines.)
        check_command("benchmarks", tokens, capsys)
