"""The API the README, its API and TP pages and the CUDA guide show exists as
they show it.

The README's API blocks (the signatures it keeps, and those that moved to
docs/api.md and docs/tp.md with their prose) are signatures written as calls (``pool.free(rows,
fence=None, *, after=None)``), not programs, and the guide's blocks are
fragments of an engine; neither runs. What can drift is checked here
instead: every name imported from ``asyncpool`` is exported (and the
README's import list names every public error), every call on a pool, a
page pool, a stream, a fence, a grant, a hold or a collector names a method
that exists and only keywords it takes (a ``*`` shown splits what may be
passed by position from what may not, as the signature does), every
attribute read on them exists, every ``stats()`` field shown is a field,
and every file they point to is there.
Nine hand-made edits of the documents (a keyword, a method, a field, an
attribute renamed, the ``*`` moved, an error dropped from the import list
or a name added to it) each fail a test here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncpool
from asyncpool import (
    AsyncReqToTokenPool,
    Grant,
    GrantHold,
    HostFence,
    HostStream,
    KVPagePool,
    KVPageStats,
    PoolError,
    PoolStats,
    QueueHead,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    record_fence,
    wait_fence,
)
from asyncpool.metrics import PoolCollector

ROOT = Path(__file__).resolve().parent.parent
#: The documents with API blocks: the README and the pages its API depth moved
#: to (docs/api.md: KV groups, the overlap step, prefix caching, metrics;
#: docs/tp.md: the tensor-parallel loop), then the CUDA guide.
API_DOCS = ("README.md", "docs/api.md", "docs/tp.md")
DOCS = (*API_DOCS, "docs/cuda.md")

#: What each name stands for in the documents' blocks (the names they use).
RECEIVERS: dict[str, tuple[type, ...]] = {
    "pool": (AsyncReqToTokenPool, ReqToTokenPool),
    "kv": (KVPagePool,),
    "pool.kv": (KVPagePool,),
    "stream": (HostStream,),
    "f": (HostFence,),
    "g": (Grant,),
    "hold": (GrantHold,),
    "collector": (PoolCollector,),
    "head": (QueueHead,),
}
#: Callables named bare in the blocks.
FUNCTIONS: dict[str, Any] = {
    "AsyncReqToTokenPool": AsyncReqToTokenPool,
    "ReqToTokenPool": ReqToTokenPool,
    "KVPagePool": KVPagePool,
    "HostStream": HostStream,
    "PoolCollector": PoolCollector,
    "ReqToTokenPoolInfo": ReqToTokenPoolInfo,
    "record_fence": record_fence,
    "wait_fence": wait_fence,
}
_CALL = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(")
_ATTR = re.compile(r"(?<![\w.])(pool\.kv|pool|kv|stream|f|g|hold|collector|head)\.([A-Za-z_]\w*)\b")
_KEYWORD = re.compile(r"^\s*\*{0,2}([A-Za-z_]\w*)\s*=(?!=)")


def _blocks(doc: str) -> list[str]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def _code(block: str) -> str:
    """The block without its comments (no ``#`` appears inside its strings)."""
    return "\n".join(line.split("#", 1)[0] for line in block.splitlines())


def _calls(code: str) -> Iterator[tuple[str, list[str]]]:
    """Each ``name(...)`` with its top-level arguments, nested calls included."""
    for m in _CALL.finditer(code):
        depth, i, start, args = 1, m.end(), m.end(), []
        while i < len(code) and depth:
            c = code[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(code[start:i])
                start = i + 1
            i += 1
        args.append(code[start : i - 1])
        yield m.group(1), [a for a in args if a.strip()]


def _keywords(args: list[str]) -> list[str]:
    return [m.group(1) for a in args if (m := _KEYWORD.match(a))]


def _targets(callee: str) -> list[Any] | None:
    """The callables ``callee`` may name, or None when it is not ours."""
    if callee in FUNCTIONS:
        return [FUNCTIONS[callee]]
    receiver, _, method = callee.rpartition(".")
    if receiver not in RECEIVERS:
        return None
    return [getattr(cls, method) for cls in RECEIVERS[receiver] if hasattr(cls, method)]


@pytest.fixture(scope="module")
def instances() -> Iterator[dict[str, list[Any]]]:
    """One live object per receiver: attributes set in ``__init__`` or by a
    delegate exist only on instances."""
    rows_pool = AsyncReqToTokenPool(4, 4)
    kv_pool = AsyncReqToTokenPool(4, 4, kv=KVPagePool(8, 2))
    sync_pool = ReqToTokenPool(4, 4)
    stream = HostStream()
    try:
        grant = kv_pool.try_admit(pages=1)
        hold = kv_pool.hold_grants()
        assert grant is not None
        yield {
            "pool": [rows_pool, kv_pool, sync_pool],
            "kv": [kv_pool.kv],
            "pool.kv": [kv_pool.kv],
            "stream": [stream],
            "f": [stream.record()],
            "g": [grant],
            "hold": [hold],
            "collector": [PoolCollector(rows_pool)],
            "head": [QueueHead("alloc", 1, 0, 0, 0.0, 1, 0)],
        }
        hold.release()
    finally:
        stream.close()


def _documented() -> list[tuple[str, int, str]]:
    return [(doc, i, block) for doc in DOCS for i, block in enumerate(_blocks(doc))]


def _params() -> list[Any]:
    return [pytest.param(doc, i, block, id=f"{doc}:{i}") for doc, i, block in _documented()]


def test_the_documents_have_the_blocks_this_test_reads() -> None:
    """The checks below read something: the README's API blocks are found,
    the signatures it keeps (the pools, the page pool, admission) and those
    that moved to docs/api.md and docs/tp.md (9 in all when they were the
    README's alone)."""
    blocks = [b for _, _, b in _documented()]
    assert len(_blocks("README.md")) >= 3
    assert sum(len(_blocks(doc)) for doc in API_DOCS) >= 9
    assert len(_blocks("docs/cuda.md")) >= 4
    calls = [c for b in blocks for c, _ in _calls(_code(b)) if _targets(c) is not None]
    assert len(calls) > 100


def test_imports_from_asyncpool_are_exported_and_every_error_is_listed() -> None:
    imported: set[str] = set()
    for _, _, block in _documented():
        code = _code(block)
        groups = re.findall(r"from asyncpool import \(([^)]*)\)", code)
        groups += re.findall(r"from asyncpool import ([^(\n]+)$", code, re.M)
        for group in groups:
            imported |= {n.strip() for n in group.replace("\n", ",").split(",") if n.strip()}
    assert imported, "no import from asyncpool found"
    assert imported <= set(asyncpool.__all__), imported - set(asyncpool.__all__)
    errors = {
        name
        for name in asyncpool.__all__
        if isinstance(getattr(asyncpool, name), type)
        and issubclass(getattr(asyncpool, name), Exception)
    }
    assert PoolError.__name__ in errors and len(errors) >= 10
    readme_import = next(b for b in _blocks("README.md") if "from asyncpool import (" in b)
    assert errors <= set(re.findall(r"\w+", _code(readme_import))), errors


def test_every_exported_name_is_documented() -> None:
    """Every name in ``asyncpool.__all__`` is named in the README or
    docs/api.md, where a newcomer looks for the API (a claims audit found
    ``OrderedFence`` and ``HistogramSnapshot`` exported and named nowhere)."""
    text = " ".join((ROOT / doc).read_text() for doc in ("README.md", "docs/api.md"))
    named = set(re.findall(r"\w+", text))
    assert set(asyncpool.__all__) <= named, sorted(set(asyncpool.__all__) - named)


@pytest.mark.parametrize(("doc", "index", "block"), _params())
def test_every_call_names_a_method_and_keywords_it_takes(doc: str, index: int, block: str) -> None:
    bad: list[str] = []
    for callee, args in _calls(_code(block)):
        targets = _targets(callee)
        if targets is None:
            continue
        if not targets:
            bad.append(f"{callee}: no such method")
            continue
        for kw in _keywords(args):
            if not any(_takes(t, kw) for t in targets):
                bad.append(f"{callee}: no keyword {kw!r}")
        bad += _star_misplaced(callee, targets, args)
    assert not bad, f"{doc} block {index}: {bad}"


def _star_misplaced(callee: str, targets: list[Any], args: list[str]) -> list[str]:
    """A shown ``*`` splits what may be passed by position from what may not."""
    stripped = [a.strip() for a in args]
    if "*" not in stripped:
        return []
    star = stripped.index("*")
    before, after = _keywords(args[:star]), _keywords(args[star + 1 :])

    def kinds(fn: Any) -> dict[str, inspect._ParameterKind]:
        return {n: p.kind for n, p in inspect.signature(fn).parameters.items()}

    if any(
        all(kinds(t).get(k) is inspect.Parameter.POSITIONAL_OR_KEYWORD for k in before)
        and all(kinds(t).get(k) is inspect.Parameter.KEYWORD_ONLY for k in after)
        for t in targets
    ):
        return []
    return [f"{callee}: the '*' shown does not match the signature"]


def _takes(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - every target has one
        return True
    if keyword in params:
        return params[keyword].kind is not inspect.Parameter.POSITIONAL_ONLY
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.parametrize(("doc", "index", "block"), _params())
def test_every_attribute_read_exists(
    doc: str, index: int, block: str, instances: dict[str, list[Any]]
) -> None:
    code = _code(block)
    bad = [
        f"{receiver}.{name}"
        for receiver, name in _ATTR.findall(code)
        if not any(hasattr(obj, name) for obj in instances[receiver])
    ]
    assert not bad, f"{doc} block {index}: {bad}"


def test_the_stats_fields_shown_are_fields() -> None:
    shown: set[str] = set()
    for _, _, block in _documented():
        for m in re.finditer(r"stats\(\)((?:\s*,?\s*\.\w+)+)", _code(block)):
            shown |= set(re.findall(r"\.(\w+)", m.group(1)))
    assert {"pages_free", "overdue_fences", "growth_refusals"} <= shown
    fields = set(PoolStats.__dataclass_fields__) | set(KVPageStats.__dataclass_fields__)
    assert shown <= fields, shown - fields


_PATH = re.compile(
    r"(?<![\w/.-])((?:tests|examples|benchmarks|asyncpool|scheduler_demo|scripts|docs)"
    r"/[\w./-]*\w)(\*?)"
)


def test_every_path_the_documents_name_exists() -> None:
    """A file the README or a document under docs/ points to is there (a
    glob, ``tests/test_*``, is not a path)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (doc.name, m.group(1))
        for doc in docs
        for m in _PATH.finditer(doc.read_text(encoding="utf-8"))
        if not m.group(2)
    }
    assert len(named) > 50
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).exists())
    assert not missing, missing


#: The torch the CUDA guide and the TP page name: their CUDA-only lines
#: cannot run here, but every name must be torch's, as the installed torch
#: spells it.
TORCH_DOCS = ("docs/cuda.md", "docs/tp.md")
_TORCH_NAME = re.compile(r"(?<![\w.])torch(?:\.[A-Za-z_]\w*)+")
#: Methods called on the guide's CUDA streams (the forward, the copy stream,
#: the scheduler thread's current one).
_STREAM_CALL = re.compile(r"(?<![\w.])(?:forward|copy|current|grant_stream)\.([A-Za-z_]\w*)\(")


def _torch_spans(doc: str) -> list[str]:
    """The document's python blocks (comments dropped) and inline code spans."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    blocks = _blocks(doc)
    prose = re.sub(r"^```python\n.*?^```", "", text, flags=re.M | re.S)
    return [_code(b) for b in blocks] + re.findall(r"`([^`\n]+)`", prose)


def _torch_object(name: str) -> Any:
    obj: Any = torch
    for part in name.split(".")[1:]:
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


def test_the_cuda_guides_torch_names_and_keywords_are_torchs() -> None:
    """Every ``torch.…`` name in docs/cuda.md and docs/tp.md exists in the
    installed torch, every keyword passed to one is a parameter of it,
    every method called on a CUDA stream of theirs (``forward.wait_stream``,
    ``copy.wait_event``) is ``torch.cuda.Stream``'s, and an attribute read
    on the loop's fence (``prev.fence.event``) is a ``CudaFence``'s. A keyword of
    ``torch.cuda.graph`` renamed, or ``wait_event`` spelled ``wait_for``,
    fails here."""
    import torch.distributed  # named by docs/tp.md: torch.distributed.…

    from asyncpool import CudaFence

    bad: list[str] = []
    names: set[str] = set()
    methods: set[str] = set()
    fence_attrs: set[str] = set()
    for doc in TORCH_DOCS:
        for span in _torch_spans(doc):
            names |= set(_TORCH_NAME.findall(span))
            methods |= set(_STREAM_CALL.findall(span))
            for callee, args in _calls(span):
                if not callee.startswith("torch."):
                    continue
                obj = _torch_object(callee)
                if obj is None:
                    continue  # reported below
                try:
                    params = inspect.signature(obj).parameters
                except (TypeError, ValueError):
                    continue
                if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    continue
                bad += [f"{doc}: {callee}({kw}=)" for kw in _keywords(args) if kw not in params]
            fence_attrs |= set(re.findall(r"\bprev\.fence\.([A-Za-z_]\w*)", span))
    assert {"torch.cuda.graph", "torch.cuda.Event", "torch.cuda.set_stream"} <= names
    assert {"wait_stream", "wait_event"} <= methods
    assert "event" in fence_attrs
    bad += sorted(f"CudaFence.{a}" for a in fence_attrs if not hasattr(CudaFence, a))
    bad += sorted(f"{name}" for name in names if _torch_object(name) is None)
    bad += sorted(f"Stream.{m}" for m in methods if not hasattr(torch.cuda.Stream, m))
    assert not bad, bad
