"""Every relative link in README.md and docs/*.md resolves.

The README is the front page and its depth lives in docs/ (demo.md, api.md,
tp.md, performance.md, testing.md), so the documents link into each other's
sections. A section renamed or moved would leave a link that GitHub shows
and that leads nowhere. Here every ``[text](target)`` and
``![alt](target)`` outside code, whose target has no scheme (``https:``,
``mailto:``), must name a file that exists (relative to the document) and,
with ``#anchor``, a heading of that file under GitHub's slug rules:
lowercase, punctuation other than ``-`` and ``_`` dropped, each space a
``-``, a repeated heading's slug suffixed ``-1``, ``-2``...
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

_FENCED = re.compile(r"^```.*?^```", re.M | re.S)
_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_'
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (outside code blocks)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for m in _HEADING.finditer(_FENCED.sub("", path.read_text(encoding="utf-8"))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The targets of a markdown file's links and images, outside code."""
    text = _SPAN.sub("", _FENCED.sub("", path.read_text(encoding="utf-8")))
    return [m.group(1) for m in _LINK.finditer(text)]


def broken_links(docs: list[Path]) -> list[str]:
    """``doc: target (why)`` for every relative link of ``docs`` that does
    not resolve; links with a scheme are not checked."""
    bad = []
    for doc in docs:
        for target in links(doc):
            if _SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{doc.name}: {target} (no such heading)")
    return bad


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_and_anchor_resolves() -> None:
    docs = _documents()
    checked = [t for d in docs for t in links(d) if not _SCHEME.match(t)]
    # The checks read something: the README's links into docs/ and back.
    assert len(checked) >= 20, checked
    assert any("#" in t for t in checked)
    assert not broken_links(docs), broken_links(docs)


def test_the_readme_links_to_every_page_its_depth_moved_to() -> None:
    targets = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    assert {
        "docs/demo.md",
        "docs/api.md",
        "docs/tp.md",
        "docs/performance.md",
        "docs/testing.md",
    } <= targets


def test_slugs_follow_githubs_rules() -> None:
    assert slug("The demo: the hazards and the fix") == "the-demo-the-hazards-and-the-fix"
    assert (
        slug("Admission: a request's row and its KV pages in one await")
        == "admission-a-requests-row-and-its-kv-pages-in-one-await"
    )
    assert slug("A hybrid model: `--swa-window` and fence_timeout") == (
        "a-hybrid-model---swa-window-and-fence_timeout"
    )


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    """The check fails on what it is for: a missing file, a missing heading
    (also in the same file), a repeated heading's second anchor taken, code
    and external links ignored."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Part\n\n## Part\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## Here: it is\n\n"
        "[ok](other.md) [ok](other.md#part) [ok](other.md#part-1) [ok](#here-it-is)\n"
        "[web](https://example.com/x#y) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad](other.md#part-2) ![img](missing.png) [self](#there)\n",
        encoding="utf-8",
    )
    assert broken_links([doc]) == [
        "doc.md: missing.md (no such file)",
        "doc.md: other.md#part-2 (no such heading)",
        "doc.md: missing.png (no such file)",
        "doc.md: #there (no such heading)",
    ]


def ambiguous_links(docs: list[Path]) -> list[str]:
    """``doc: target`` for every relative link whose anchor is the slug of
    a heading that its file repeats (``## Metrics`` and a ``### metrics``
    above it): the link lands on the first, which may not be the one meant,
    and adding such a heading moves every existing link without breaking it."""
    bad = []
    for doc in docs:
        for target in links(doc):
            file_part, _, anchor = target.partition("#")
            if _SCHEME.match(target) or not anchor:
                continue
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if dest.suffix == ".md" and dest.exists() and f"{anchor}-1" in anchors(dest):
                bad.append(f"{doc.name}: {target}")
    return bad


def test_no_link_lands_on_a_heading_its_file_repeats(tmp_path: Path) -> None:
    """docs/api.md's contracts are one ``###`` subsection each, and a
    *metrics* subsection above ``## Metrics`` would have taken the
    README's ``docs/api.md#metrics`` link; so the subsection is named
    *metrics exporter*. The check finds such a link, here and in the
    documents."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n### metrics\n\n## Metrics\n\n## Other\n\n"
        "[m](#metrics) [m1](#metrics-1) [o](#other)\n",
        encoding="utf-8",
    )
    assert ambiguous_links([doc]) == ["doc.md: #metrics"]
    assert not ambiguous_links(_documents()), ambiguous_links(_documents())
