"""What the batched page calls a scheduler makes every step cost per row.

``python -m benchmarks.batch_calls`` (``--rows 8,32,256``, ``--rounds 7``). An
overlap scheduler calls these for its whole batch on every step, so their
per-row Python work is paid every step. On a pool with KV groups
(``{"full": ..., "swa": ...}``, 16 token slots a page) and, for the one-kv
figures, a pool with one ``KVPagePool``, at each batch size:

* ``drop_pages(rows, j, group="swa")``: a window's slide, one page a row
  (each step first grows every row a swa page, untimed), against the same
  drop per row (``drop_pages([row], j, group="swa")``); and the slide's
  growth, ``extend_rows(rows, 1, group="swa")`` after each step's drop
  (untimed), against the same growth of rows that never dropped (the
  grouped growth's below);
* ``trim_pages(rows, {"full": keeps, "swa": keeps})``: a speculative
  rollback, 1 to 3 pages a row in both groups (each step's drafts grown
  first, untimed), against ``trim_pages(rows, keeps, group=...)`` per
  group and against the same trim per row; and ``trim_pages(rows, keeps)``
  on one kv;
* ``extend_rows(rows, {"full": 1, "swa": 1})`` against the two one-group
  calls and against ``extend_rows(rows, 1)`` on one kv (every 16 steps the
  rows are trimmed back, untimed);
* ``pages_of_rows(rows, group="full")`` against ``pages_of`` per row;
* on one row of ``--long`` pages (1,024 and 32,768; one kv, page size 1): a
  speculative step's rollback and regrowth, ``trim_pages(row, n - 1)`` then
  ``extend(row, 1)`` timed together, and ``trim_pages(row, n)`` alone (a
  page grown first, untimed), each against the same cycle with a
  ``pages_of(row)`` each step (untimed), which lends the row's record so
  that the trim lets its growth buffer go and the growth copies the record;
  and a sliding window's step on a row of as many live pages,
  ``drop_pages(row, d + 1)`` (``d``: ``pages_dropped(row)``) then
  ``extend(row, 1)`` timed together, and the drop alone (a page grown
  first, untimed).

Each figure is the best of ``--rounds`` rounds (subject and reference
alternated round by round) of a timed call, in microseconds a call and a
row. No fences: pages given back are free at once. Prints a table; writes
nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

PAGE_SIZE = 16
STEPS = 16
ADMIT = 4


def _pools(n: int) -> tuple[Any, list[int], Any, list[int]]:
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    num = n * (ADMIT + STEPS * 4 + 8) + 1
    grouped: Any = AsyncReqToTokenPool(
        n + 1,
        1 << 16,
        kv={
            "full": KVPagePool(num, PAGE_SIZE, name="full"),
            "swa": KVPagePool(num, PAGE_SIZE, name="swa"),
        },
    )
    one: Any = AsyncReqToTokenPool(n + 1, 1 << 16, kv=KVPagePool(num, PAGE_SIZE))
    rows_g = [grouped.try_admit({"full": ADMIT, "swa": ADMIT}).row for _ in range(n)]
    rows_1 = [one.try_admit(pages=ADMIT).row for _ in range(n)]
    return grouped, rows_g, one, rows_1


def _timed(setup: Callable[[int], None], call: Callable[[int], None], steps: int) -> float:
    """Seconds of ``call(i)`` summed over ``steps`` steps, ``setup(i)`` untimed."""
    total = 0.0
    clock = time.perf_counter
    for i in range(steps):
        setup(i)
        t0 = clock()
        call(i)
        total += clock() - t0
    return total


def _bench(
    rounds: int,
    steps: int,
    cases: Sequence[tuple[str, Callable[[int], None], Callable[[int], None]]],
) -> dict[str, float]:
    """Best seconds a call of each case, the cases alternated round by round."""
    best = {name: float("inf") for name, _, _ in cases}
    for _ in range(rounds):
        for name, setup, call in cases:
            best[name] = min(best[name], _timed(setup, call, steps) / steps)
    return best


def _nothing(i: int) -> None:
    pass


def measure(n: int, rounds: int, steps: int) -> list[tuple[str, float, float]]:
    """``[(label, us a call, us a row)]`` for batches of ``n`` rows."""
    import numpy as np

    grouped, rows, one, rows1 = _pools(n)
    g, p = grouped, one
    drafts = [1 + i % 3 for i in range(n)]
    keeps = [ADMIT] * n
    both = {"full": keeps, "swa": keeps}
    out: dict[str, float] = {}

    # The window's slide: grow a swa page, drop the oldest.
    state = {"below": 0}

    def fresh() -> None:
        g.free(rows)
        rows[:] = [g.try_admit({"full": ADMIT, "swa": ADMIT}).row for _ in range(n)]
        state["below"] = 0

    def grow_swa(i: int) -> None:
        if i % STEPS == 0:
            fresh()
        g.extend_rows(rows, 1, group="swa")
        state["below"] += 1

    def drop(i: int) -> None:
        g.drop_pages(rows, state["below"], group="swa")

    def drop_each(i: int) -> None:
        below = state["below"]
        for row in rows:
            g.drop_pages([row], below, group="swa")

    def drop_first(i: int) -> None:
        if i % STEPS == 0:
            fresh()
        else:
            g.drop_pages(rows, state["below"], group="swa")

    def grow_after(i: int) -> None:
        g.extend_rows(rows, 1, group="swa")
        state["below"] += 1

    out.update(
        _bench(
            rounds,
            steps,
            [
                ('drop_pages(rows, below, group="swa")', grow_swa, drop),
                ("  per row: drop_pages([row], ...)", grow_swa, drop_each),
                (
                    '  its growth: extend_rows(rows, 1, group="swa") after it',
                    drop_first,
                    grow_after,
                ),
            ],
        )
    )
    fresh()

    # A speculative rollback in both groups.
    def grow_drafts(i: int) -> None:
        g.extend_rows(rows, {"full": drafts, "swa": drafts})

    def grow_drafts1(i: int) -> None:
        p.extend_rows(rows1, drafts)

    def trim(i: int) -> None:
        g.trim_pages(rows, both)

    def trim_apart(i: int) -> None:
        g.trim_pages(rows, keeps, group="full")
        g.trim_pages(rows, keeps, group="swa")

    def trim_each(i: int) -> None:
        for row in rows:
            g.trim_pages([row], {"full": ADMIT, "swa": ADMIT})

    def trim_array(i: int) -> None:
        g.trim_pages(rows, {"full": keeps_np, "swa": keeps_np})

    def trim1(i: int) -> None:
        p.trim_pages(rows1, keeps)

    keeps_np = np.array(keeps, dtype=np.int64)
    out.update(
        _bench(
            rounds,
            steps,
            [
                ('trim_pages(rows, {"full": keeps, "swa": keeps})', grow_drafts, trim),
                ("  keeps as numpy arrays", grow_drafts, trim_array),
                ("  per group: trim_pages(rows, keeps, group=...) x2", grow_drafts, trim_apart),
                ("  per row: trim_pages([row], {...})", grow_drafts, trim_each),
                ("trim_pages(rows, keeps) (one kv)", grow_drafts1, trim1),
            ],
        )
    )

    # A decode step's growth.
    def back(i: int) -> None:
        if i % STEPS == 0:
            g.trim_pages(rows, ADMIT, group="full")
            g.trim_pages(rows, ADMIT, group="swa")
            p.trim_pages(rows1, ADMIT)

    def ext2(i: int) -> None:
        g.extend_rows(rows, {"full": 1, "swa": 1})

    def ext_apart(i: int) -> None:
        g.extend_rows(rows, 1, group="full")
        g.extend_rows(rows, 1, group="swa")

    def ext1(i: int) -> None:
        p.extend_rows(rows1, 1)

    out.update(
        _bench(
            rounds,
            steps,
            [
                ('extend_rows(rows, {"full": 1, "swa": 1})', back, ext2),
                ("  per group: extend_rows(rows, 1, group=...) x2", back, ext_apart),
                ("extend_rows(rows, 1) (one kv)", back, ext1),
            ],
        )
    )
    back(0)

    def table(i: int) -> None:
        g.pages_of_rows(rows, group="full")

    def table_each(i: int) -> None:
        for row in rows:
            g.pages_of(row, group="full")

    out.update(
        _bench(
            rounds,
            steps,
            [
                ('pages_of_rows(rows, group="full")', _nothing, table),
                ('  per row: pages_of(row, group="full")', _nothing, table_each),
            ],
        )
    )
    return [(label, s * 1e6, s * 1e6 / n) for label, s in out.items()]


def measure_long(n: int, rounds: int, steps: int) -> list[tuple[str, float]]:
    """``[(label, us a call)]`` for one row of ``n`` pages (page size 1):
    the rollback-and-regrowth cycle and the trim alone, each without and
    with a ``pages_of`` of the row every step (untimed); and a sliding
    window's step on a row of ``n`` live pages, the drop of its first live
    page and a growth of one, and the drop alone."""
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    pool: Any = AsyncReqToTokenPool(2, 1 << 22, kv=KVPagePool(n + 16, 1))
    row = pool.try_admit(pages=n).row
    pool.extend(row, 1)  # the record lives in a growth buffer, as a decoding row's
    pool.trim_pages(row, n)

    def cycle(i: int) -> None:
        pool.trim_pages(row, n - 1)
        pool.extend(row, 1)

    def grow(i: int) -> None:
        pool.extend(row, 1)

    def read_and_grow(i: int) -> None:
        pool.pages_of(row)
        pool.extend(row, 1)

    def read(i: int) -> None:
        pool.pages_of(row)

    def trim(i: int) -> None:
        pool.trim_pages(row, n)

    # A sliding window's step on a row of n live pages: the page that slid
    # out dropped, one grown (its record a view past the dropped places).
    window: Any = AsyncReqToTokenPool(2, 1 << 22, kv=KVPagePool(n + 16, 1))
    slid = window.try_admit(pages=n).row
    window.extend(slid, 1)
    window.drop_pages(slid, 1)

    def slide(i: int) -> None:
        window.drop_pages(slid, window.pages_dropped(slid) + 1)
        window.extend(slid, 1)

    def grow_slid(i: int) -> None:
        window.extend(slid, 1)

    def drop(i: int) -> None:
        window.drop_pages(slid, window.pages_dropped(slid) + 1)

    best = _bench(
        rounds,
        steps,
        [
            ("trim_pages(row, n - 1); extend(row, 1)", _nothing, cycle),
            ("  with pages_of(row) each step (lent: a copy)", read, cycle),
            ("trim_pages(row, n) after extend(row, 1)", grow, trim),
            ("  with pages_of(row) each step (lent)", read_and_grow, trim),
            ("drop_pages(row, d + 1); extend(row, 1)", _nothing, slide),
            ("drop_pages(row, d + 1) after extend(row, 1)", grow_slid, drop),
        ],
    )
    pool.free([row])
    window.free([slid])
    return [(label, s * 1e6) for label, s in best.items()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,32,256", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per case (best kept)")
    parser.add_argument("--steps", type=int, default=48, help="timed calls per round")
    parser.add_argument(
        "--long", default="1024,32768", help="comma-separated page counts of the one long row"
    )
    args = parser.parse_args(argv)

    def whole_numbers(option: str, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",")]
        except ValueError:
            parser.error(f"{option} takes comma-separated whole numbers, got {text!r}")

    sizes = whole_numbers("--rows", args.rows)
    longs = whole_numbers("--long", args.long)
    if min(sizes) < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--rows sizes, --rounds and --steps must be at least 1")
    if min(longs) < 2:
        parser.error("--long page counts must be at least 2")
    for n in sizes:
        print(f"\n{n} rows: us a call, us a row")
        for label, call, row in measure(n, args.rounds, args.steps):
            print(f"  {label:56s} {call:9.1f} {row:7.2f}")
    for n in longs:
        print(f"\none row of {n} pages (page size 1): us a call")
        for label, call in measure_long(n, args.rounds, args.steps):
            print(f"  {label:56s} {call:9.1f}")


if __name__ == "__main__":
    main()
