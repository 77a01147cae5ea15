"""The sliding-window KV group of the demo's hybrid model (``--swa-window W``).

A hybrid model's sliding-window layers attend to the last ``W`` positions
only: the step that computes position ``q`` reads positions
``[lo(q), q]``, ``lo(q) = max(0, q - W + 1)``. Their KV lives in a second
page pool, the pool's ``"swa"`` group, beside the full-attention layers'
``"full"`` group (the demo's ``kv_pages``), and a request holds only the swa
pages its window spans:

* admission takes the swa pages from the one holding ``lo(q0)`` (``q0``: the
  first step's last position) up to the page boundary where the full
  group's pages end, so both groups cross their next page boundary at the
  same position and grow together (one ``extend_fitting(rows, {"full": 1,
  "swa": 1})``);
* after launching each step the scheduler gives back, with
  ``drop_pages(rows, below, group="swa")``, the pages below the page of
  ``lo(next position)``: no later step reads them, but the step just
  launched may still read the last one, so (fenced) they wait behind the
  row's recorded use; ``--unsafe`` records no use, so they go back at once,
  as a free does there;
* each step writes every new token's KV in both groups and reads back the
  whole window of each request from the swa group: a swa slot holding
  another request's value is a swa KV corruption.

The host keeps, per row, the swa slot of each position the row's swa pages
cover (``mirror[row, pos]``; the page ids come from the grants and growths,
as ``pool.pages_of(row, group="swa")`` lists them), where those pages start
(``base``, in pages from position 0) and end, and how many of them the pool
has dropped. The KV of both groups lives in one tensor: the full group's
slots first, the swa group's from ``offset`` on.

Thread rules: everything here runs on the scheduler's (event loop's) thread.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from asyncpool import AsyncReqToTokenPool

__all__ = ["SwaGroup", "SwaStep"]

logger = logging.getLogger(__name__)


class SwaStep(NamedTuple):
    """What a step does in the swa group (numpy, int64): the KV it writes
    (``w_slots``, ``w_vals``) and the window it reads back (``v_slots``,
    ``v_vals``, ``v_counts`` positions per entry of the batch, in order)."""

    w_slots: np.ndarray
    w_vals: np.ndarray
    v_slots: np.ndarray
    v_vals: np.ndarray
    v_counts: np.ndarray


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lens))``, vectorised."""
    total = int(lens.sum())
    offs = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    out: np.ndarray = np.repeat(starts, lens) + offs
    return out


class SwaGroup:
    """The host's record of every row's swa pages, and the drops.

    ``window``: tokens; ``page_size``: token slots a page; ``rows``: the
    pool's rows (row 0, padding, on top); ``max_slots``: positions a row can
    have; ``offset``: the swa group's first slot in the KV tensor.
    """

    def __init__(self, window: int, page_size: int, rows: int, max_slots: int, offset: int) -> None:
        if window < 1 or page_size < 1:
            raise ValueError("window and page_size must be >= 1")
        self.window = window
        self.ps = page_size
        self.offset = offset
        self.mirror = np.zeros((rows + 1, max_slots), dtype=np.int64)
        self.base = np.zeros(rows + 1, dtype=np.int64)  # first page, in pages from position 0
        self.end = np.zeros(rows + 1, dtype=np.int64)  # one past the last page, likewise
        self.dropped = np.zeros(rows + 1, dtype=np.int64)  # pages given back, from base on
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.pages_dropped = 0  # pages given back by drop_pages over the run
        self.undropped_peak = 0  # the most pages the batch's rows would hold without drops

    def lo(self, q: int) -> int:
        """The first position the step computing position ``q`` reads."""
        return max(0, q - self.window + 1)

    def admission(self, q0: int, full_pages: int) -> tuple[int, int]:
        """``(base, count)``: the swa pages of a request whose first step
        computes up to position ``q0`` and that is admitted with
        ``full_pages`` pages of the full group (covering ``[0, full_pages *
        page_size)``): from the page of ``lo(q0)`` up to the same end."""
        base = self.lo(q0) // self.ps
        return base, full_pages - base

    def start(self, row: int, base: int, pages: list[int]) -> None:
        """``row`` was granted ``pages`` from page ``base`` on."""
        self.base[row] = self.end[row] = base
        self.dropped[row] = 0
        self.add(row, pages)

    def add(self, row: int, pages: list[int]) -> None:
        """``row`` grew by ``pages`` (after its last)."""
        ps = self.ps
        at = int(self.end[row]) * ps
        for p in pages:
            self.mirror[row, at : at + ps] = self.offset + p * ps + self._offsets
            at += ps
        self.end[row] += len(pages)

    def slots(self, row: int, lo: int, hi: int) -> np.ndarray:
        """The swa slots of ``row``'s positions ``[lo, hi)`` (all live)."""
        self._check_live(np.array([row]), np.array([lo]), np.array([hi]))
        return self.mirror[row, lo:hi]

    def live_window(self, row: int, hi: int) -> np.ndarray:
        """The swa slots of ``row``'s window up to position ``hi`` that its
        pages still hold (a later step may have dropped the first ones)."""
        first = int(self.base[row] + self.dropped[row]) * self.ps
        return self.mirror[row, max(self.lo(hi), first) : hi]

    def final_window(self, row: int, end: int) -> tuple[int, np.ndarray]:
        """The window a finished request (positions ``[0, end)`` computed)
        read last, ``[lo(end - 1), end)``, from the first position its pages
        still hold: ``(that position, the slots from it to end)``. The pages a
        drop gave back are the row's no more (a fence away from a new owner),
        so their slots are not the request's to check at the end."""
        first = int(self.base[row] + self.dropped[row]) * self.ps
        start = min(max(self.lo(end - 1), first), end)
        return start, self.mirror[row, start:end].copy()

    def build(
        self, rows: np.ndarray, ends: np.ndarray, write_from: np.ndarray, bases: np.ndarray
    ) -> SwaStep:
        """A step's swa work: each entry (``rows[i]``, computing up to
        position ``ends[i] - 1``) writes the KV of positions ``[max(write_from[i],
        window start), ends[i])`` and reads back its window."""
        lo = np.maximum(ends - self.window, 0)  # lo(ends - 1)
        w_from = np.maximum(write_from, lo)
        self._check_live(rows, lo, ends)
        w_lens = ends - w_from
        w_pos = _ranges(w_from, w_lens)
        w_rows = np.repeat(rows, w_lens)
        v_lens = ends - lo
        v_pos = _ranges(lo, v_lens)
        v_rows = np.repeat(rows, v_lens)
        self.undropped_peak = max(self.undropped_peak, int(self.end[rows].sum()))
        return SwaStep(
            self.mirror[w_rows, w_pos],
            np.repeat(bases, w_lens) + w_pos,
            self.mirror[v_rows, v_pos],
            np.repeat(bases, v_lens) + v_pos,
            v_lens,
        )

    def _check_live(self, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        first = (self.base[rows] + self.dropped[rows]) * self.ps
        if np.any(lo < first) or np.any(hi > self.end[rows] * self.ps):
            raise RuntimeError(
                f"swa positions outside the rows' live pages: rows {rows.tolist()}, "
                f"[{lo.tolist()}, {hi.tolist()}) vs [{first.tolist()}, "
                f"{(self.end[rows] * self.ps).tolist()})"
            )

    def drop(self, pool: AsyncReqToTokenPool, rows: list[int], next_pos: list[int]) -> int:
        """Give back the pages of ``rows`` that no step from ``next_pos`` on
        reads (the pages below the one holding ``lo(next_pos)``), behind each
        row's recorded uses (``drop_pages``: the step just launched may still
        read the last of them). Returns the pages given back."""
        todo: list[int] = []
        below: list[int] = []
        for row, pos in zip(rows, next_pos, strict=True):
            b = self.lo(pos) // self.ps - int(self.base[row])
            if b > self.dropped[row]:
                todo.append(row)
                below.append(b)
        if not todo:
            return 0
        pool.drop_pages(todo, below, group="swa")
        n = sum(below) - int(self.dropped[todo].sum())
        self.dropped[todo] = below
        self.pages_dropped += n
        return n
