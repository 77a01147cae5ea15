"""The run's figures: a :class:`Report`, its table and its JSON form."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from asyncpool import KVPagePool

    from .scheduler import Scheduler

__all__ = ["Report", "Sample", "Trace", "percentile", "swa_figures"]


class Sample(NamedTuple):
    """The pool and the scheduler at one scheduler iteration."""

    t_s: float  # since the run started
    allocated: int  # rows owned by a request
    pending: int  # rows freed but held behind a fence
    free: int
    waiters: int  # requests waiting for admission (rows and/or pages)
    running: int  # requests in the batch
    pages_allocated: int  # KV pages owned by a request
    pages_pending: int  # KV pages freed but held behind a fence
    pages_free: int
    retractions: int  # so far
    completed: int  # so far
    aborted: int  # so far


@dataclass
class Trace:
    """Time series for the plot; not part of the JSON.

    ``timeline``: one :class:`Sample` per scheduler iteration.
    ``alloc_waits``: seconds from a request's arrival (or retraction) until
    its row and first pages were granted.
    ``abort_times``: when each client abort was handled (seconds since the start).
    """

    timeline: list[Sample] = field(default_factory=list)
    alloc_waits: list[float] = field(default_factory=list)
    capacity: int = 0
    page_capacity: int = 0
    abort_times: list[float] = field(default_factory=list)

    def pages_over_time(self, points: int = 200) -> dict[str, list[float]]:
        """The pages timeline, thinned to at most ``points`` samples (for JSON)."""
        tl = self.timeline
        step = max(1, math.ceil(len(tl) / points))
        picked = tl[::step]
        return {
            "t_s": [round(s.t_s, 4) for s in picked],
            "allocated": [s.pages_allocated for s in picked],
            "pending": [s.pages_pending for s in picked],
            "free": [s.pages_free for s in picked],
        }


@dataclass
class Report:
    """What one run measured. ``corruptions`` counts requests whose row
    (``req_to_token`` entries, ``verified_lens``) disagreed with the host's
    truth at least once, ``kv_corruptions`` those whose KV pages did (a slot
    they own held another request's value); ``mismatches`` and
    ``kv_mismatches`` count every disagreeing check. ``row_utilization`` is
    the mean of requests running over the mean of rows allocated, both read
    at the same scheduler iterations.

    ``swa``: a hybrid model's sliding-window group (``--swa-window``; None
    without one, and then not in the JSON): see :func:`swa_figures`. The
    fields above are then the full group's (``kv_corruptions``,
    ``deferred_page_frees``, the pages over time)."""

    mode: str
    unsafe: bool
    device: str
    admission: str
    requests: int
    completed: int
    aborts: int
    aborts_in_transfer: int
    aborts_in_decode: int
    output_tokens: int
    computed_tokens: int
    elapsed_s: float
    tokens_per_s: float
    steps: int
    steps_per_s: float
    mean_batch_size: float
    alloc_wait_p50_ms: float
    alloc_wait_p99_ms: float
    retractions: int
    deferred_frees: int
    deferred_page_frees: int
    fence_latency_p50_ms: float
    fence_latency_p99_ms: float
    corruptions: int
    mismatches: int
    kv_corruptions: int
    kv_mismatches: int
    peak_allocated: int
    row_utilization: float
    mean_rows_allocated: float
    mean_pages_allocated: float
    transfer_ms: float
    transfers: int
    stalls: int
    forward_busy: float  # fraction of the run the forward stream spent in steps
    forward_ms_per_step: float  # mean time of a step on the forward stream (CUDA: events)
    sched_cpu_ms_per_step: float  # the event loop thread's CPU time per step
    config: dict[str, Any] = field(default_factory=dict)
    swa: dict[str, Any] | None = None
    trace: Trace = field(default_factory=Trace, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """A safe run that completed or aborted every request, with no
        corruption of either kind."""
        return (
            not self.unsafe
            and self.corruptions == 0
            and self.kv_corruptions == 0
            and (self.swa is None or self.swa["kv_corruptions"] == 0)
            and self.completed + self.aborts == self.requests
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON fields: every scalar field, the config and the pages over
        time (``pages``: ``t_s``, ``allocated``, ``pending``, ``free``);
        ``swa`` only for a hybrid model."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        out["config"] = dict(self.config)
        if self.swa is None:
            del out["swa"]
        else:
            out["swa"] = dict(self.swa)
        out["pages"] = self.trace.pages_over_time()
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> str:
        """A human-readable summary table."""
        label = (
            f"{self.mode}{' --unsafe' if self.unsafe else ' (fenced)'}, "
            f"{self.admission} admission, on {self.device}"
        )
        rows = [
            ("requests completed", f"{self.completed} / {self.requests}"),
            (
                "aborted by clients",
                f"{self.aborts} ({self.aborts_in_transfer} mid-transfer, "
                f"{self.aborts_in_decode} mid-decode)",
            ),
            ("elapsed", f"{self.elapsed_s:.2f} s"),
            ("tokens/s (output)", f"{self.tokens_per_s:,.0f}"),
            ("steps/s", f"{self.steps_per_s:,.1f}"),
            ("mean batch size", f"{self.mean_batch_size:.1f}"),
            (
                "row utilization",
                f"{self.row_utilization:.2f} (requests running / rows allocated, "
                f"{self.mean_rows_allocated:.1f} rows allocated on average)",
            ),
            (
                "admission wait p50 / p99",
                f"{self.alloc_wait_p50_ms:.2f} / {self.alloc_wait_p99_ms:.2f} ms",
            ),
            ("prompt KV transfers", f"{self.transfers} (about {self.transfer_ms:g} ms each)"),
            ("retractions", f"{self.retractions}"),
            ("deferred frees: rows / pages", f"{self.deferred_frees} / {self.deferred_page_frees}"),
            (
                "fence latency p50 / p99",
                f"{self.fence_latency_p50_ms:.2f} / {self.fence_latency_p99_ms:.2f} ms",
            ),
            ("peak rows allocated", f"{self.peak_allocated} / {self.config.get('rows', '?')}"),
            (
                "mean KV pages allocated",
                f"{self.mean_pages_allocated:.0f} / {self.config.get('kv_pages', '?')}",
            ),
            (
                "per step: forward / scheduler CPU",
                f"{self.forward_ms_per_step:.2f} / {self.sched_cpu_ms_per_step:.2f} ms",
            ),
            ("forward stream busy", f"{100 * self.forward_busy:.0f} %"),
            (
                "corruptions (rows)",
                f"{self.corruptions}"
                + (f" ({self.mismatches} mismatches)" if self.mismatches else ""),
            ),
            (
                "kv_corruptions (pages)" if self.swa is None else "kv_corruptions (full pages)",
                f"{self.kv_corruptions}"
                + (f" ({self.kv_mismatches} mismatches)" if self.kv_mismatches else ""),
            ),
        ]
        if self.swa is not None:
            rows += _swa_rows(self.swa)
        width = max(len(k) for k, _ in rows)
        lines = [f"scheduler_demo: {label}", "-" * (width + 24)]
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines)


def swa_figures(sched: Scheduler, pages: KVPagePool) -> dict[str, Any]:
    """The sliding-window group's figures after a run: ``window`` (tokens),
    ``pages`` (its capacity), ``peak_allocated`` (its pool's),
    ``undropped_peak`` (the most pages one step's rows would have held had
    they kept every page from position 0: what the group would need without
    the drops), ``pages_dropped`` (given back by ``drop_pages`` while their
    requests ran), ``deferred_page_frees`` (its pages that waited for a
    fence), ``kv_corruptions`` (requests whose window read back another's
    KV at least once, at a step or, finished, in the end-of-run check of
    their last window) and ``kv_mismatches`` (every such check)."""
    group = sched.swa
    assert group is not None
    st = pages.stats()
    return {
        "window": group.window,
        "pages": pages.capacity,
        "peak_allocated": st.peak_allocated,
        "undropped_peak": group.undropped_peak,
        "pages_dropped": group.pages_dropped,
        "deferred_page_frees": st.deferred_frees,
        "kv_corruptions": len(sched.swa_corrupted),
        "kv_mismatches": sched.swa_mismatches,
    }


def _swa_rows(swa: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "swa window / pages",
            f"{swa['window']} tokens / {swa['pages']} pages "
            f"(peak {swa['peak_allocated']}; {swa['undropped_peak']} without drops)",
        ),
        (
            "swa pages dropped / deferred",
            f"{swa['pages_dropped']} / {swa['deferred_page_frees']}",
        ),
        (
            "kv_corruptions (swa pages)",
            f"{swa['kv_corruptions']}"
            + (f" ({swa['kv_mismatches']} mismatches)" if swa["kv_mismatches"] else ""),
        ),
    ]


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; 0.0 for no samples."""
    if not samples:
        return 0.0
    s = sorted(samples)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
