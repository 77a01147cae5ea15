"""The run's figure: rows and KV pages over time (aborts marked), what is
held behind fences, and admission waits.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global
backend switch, no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .report import Report

__all__ = ["save_plot"]

_ALLOCATED, _PENDING, _FREE = "#4c72b0", "#dd8452", "#c7d3e3"


def save_plot(report: Report, path: str | Path) -> None:
    """Write a PNG with four panels to ``path``."""
    fig = Figure(figsize=(12.5, 13), layout="constrained")
    FigureCanvasAgg(fig)
    rows_ax, pages_ax, fence_ax, wait_ax = fig.subplots(4, 1, height_ratios=[3, 3, 2, 2])
    label = f"{report.mode}{' --unsafe' if report.unsafe else ' (fenced)'}"
    fig.suptitle(
        f"scheduler_demo {label}, {report.admission} admission: "
        f"{report.completed} completed + {report.aborts} aborted / {report.requests} requests, "
        f"{report.tokens_per_s:,.0f} tokens/s\n{report.retractions} retractions, "
        f"deferred frees {report.deferred_frees} rows / {report.deferred_page_frees} pages, "
        f"corruptions {report.corruptions} rows / {report.kv_corruptions} KV, "
        f"row utilization {report.row_utilization:.2f}"
    )
    _rows_panel(rows_ax, report)
    _pages_panel(pages_ax, report)
    _fence_panel(fence_ax, report)
    _wait_panel(wait_ax, report)
    fig.savefig(path, format="png", dpi=100)


def _rows_panel(ax: Axes, report: Report) -> None:
    tl = report.trace.timeline
    ax.set_title("request rows of the pool")
    ax.set_xlabel("time (s)")
    if not tl:
        return
    t = [s.t_s for s in tl]
    ax.stackplot(
        t,
        [s.allocated for s in tl],
        [s.pending for s in tl],
        [s.free for s in tl],
        labels=["allocated", "pending (behind a fence)", "free"],
        colors=[_ALLOCATED, _PENDING, _FREE],
        step="post",
    )
    running = [s.running for s in tl]
    ax.plot(t, running, color="#55a868", linewidth=0.9, label="in the running batch")
    ax.set_ylim(0, max(report.trace.capacity, 1))
    ax.set_ylabel("rows")
    twin = ax.twinx()
    twin.plot(
        t, [s.waiters for s in tl], color="#222222", linewidth=0.9, label="waiting for admission"
    )
    twin.plot(t, [s.completed for s in tl], color="#7b3294", label="completed (cumulative)")
    twin.plot(t, [s.retractions for s in tl], color="#c44e52", label="retractions (cumulative)")
    twin.plot(t, [s.aborted for s in tl], color="#937860", label="aborted (cumulative)")
    twin.set_ylabel("requests")
    twin.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    _legend_right(ax, h1 + h2, l1 + l2)


def _pages_panel(ax: Axes, report: Report) -> None:
    tl = report.trace.timeline
    ax.set_title("KV pages of the cache (client aborts marked at the top)")
    ax.set_xlabel("time (s)")
    if not tl:
        return
    t = [s.t_s for s in tl]
    ax.stackplot(
        t,
        [s.pages_allocated for s in tl],
        [s.pages_pending for s in tl],
        [s.pages_free for s in tl],
        labels=["allocated", "pending (behind a step or a transfer)", "free"],
        colors=[_ALLOCATED, _PENDING, _FREE],
        step="post",
    )
    top = max(report.trace.page_capacity, 1)
    ax.set_ylim(0, top * 1.06)
    ax.set_ylabel("pages")
    if report.trace.abort_times:
        ax.plot(
            report.trace.abort_times,
            [top * 1.03] * len(report.trace.abort_times),
            linestyle="none",
            marker="v",
            markersize=4,
            color="#c44e52",
            label=f"client abort ({report.aborts})",
        )
    h, lab = ax.get_legend_handles_labels()
    _legend_right(ax, h, lab)


def _legend_right(ax: Axes, handles: list[Any], labels: list[str]) -> None:
    """The legend outside the panel, on its right (it hides no data)."""
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.07, 1.0), fontsize="small")


def _binned(t: list[float], y: list[int], bins: int) -> tuple[list[float], list[float], list[int]]:
    """Mean and max of ``y`` in ``bins`` equal time bins (empty bins skipped)."""
    span = (t[-1] - t[0]) or 1.0
    sums = [0.0] * bins
    counts = [0] * bins
    peaks = [0] * bins
    for ti, yi in zip(t, y, strict=True):
        b = min(bins - 1, int((ti - t[0]) / span * bins))
        sums[b] += yi
        counts[b] += 1
        peaks[b] = max(peaks[b], yi)
    mids = [t[0] + (b + 0.5) * span / bins for b in range(bins) if counts[b]]
    means = [sums[b] / counts[b] for b in range(bins) if counts[b]]
    maxes = [peaks[b] for b in range(bins) if counts[b]]
    return mids, means, maxes


def _fence_panel(ax: Axes, report: Report) -> None:
    tl = report.trace.timeline
    ax.set_title(
        "freed while a step or a transfer in flight still writes them: held behind its fence"
        if not report.unsafe
        else "--unsafe: rows and pages are freed at once, nothing is held behind a fence"
    )
    ax.set_xlabel("time (s)")
    if not tl:
        return
    t = [s.t_s for s in tl]
    mids, means, maxes = _binned(t, [s.pages_pending for s in tl], bins=120)
    ax.fill_between(
        mids, means, step="mid", color=_PENDING, alpha=0.9, label="pending pages (mean)"
    )
    ax.plot(mids, maxes, drawstyle="steps-mid", color="#8c4a1c", linewidth=0.8, label="(max)")
    ax.set_ylabel("pending KV pages")
    ax.set_ylim(bottom=0, top=max(3, max(maxes) * 1.15 + 1))
    twin = ax.twinx()
    rmids, rmeans, rmaxes = _binned(t, [s.pending for s in tl], bins=120)
    twin.plot(rmids, rmeans, drawstyle="steps-mid", color="#4c72b0", label="pending rows (mean)")
    twin.set_ylabel("pending rows")
    twin.set_ylim(bottom=0, top=max(3, max(rmaxes) * 1.15 + 1))
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    _legend_right(ax, h1 + h2, l1 + l2)


def _wait_panel(ax: Axes, report: Report) -> None:
    how = (
        "await pool.admit(pages=n)"
        if report.admission == "atomic"
        else "await pool.alloc(1), then pool.extend(row, n)"
    )
    ax.set_title(f"admission wait, arrival (or retraction) to a row and its pages: {how}")
    ax.set_ylabel("admissions")
    waits = report.trace.alloc_waits
    if not waits:
        return
    # Seconds when the backpressure is long (the default run), else ms.
    unit, scale = ("s", 1.0) if max(waits) > 10.0 else ("ms", 1e3)
    ax.set_xlabel(f"wait ({unit})")
    ax.hist([w * scale for w in waits], bins=60, color="#8172b3")
    ax.axvline(report.alloc_wait_p50_ms * scale / 1e3, color="k", linestyle="--", label="p50")
    ax.axvline(report.alloc_wait_p99_ms * scale / 1e3, color="r", linestyle="--", label="p99")
    ax.set_yscale("log")
    h, lab = ax.get_legend_handles_labels()
    _legend_right(ax, h, lab)
