"""The run's figure: rows over time and the alloc wait-time distribution.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global
backend switch, no display needed).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .report import Report

__all__ = ["save_plot"]


def save_plot(report: Report, path: str | Path) -> None:
    """Write a PNG with two panels to ``path``."""
    trace = report.trace
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])

    label = f"{report.mode}{' --unsafe' if report.unsafe else ' (fenced)'}"
    if trace.timeline:
        t = [row[0] for row in trace.timeline]
        allocated = [row[1] for row in trace.timeline]
        pending = [row[2] for row in trace.timeline]
        free = [row[3] for row in trace.timeline]
        waiters = [row[4] for row in trace.timeline]
        top.stackplot(
            t,
            allocated,
            pending,
            free,
            labels=["allocated", "pending (behind a fence)", "free"],
            colors=["#4c72b0", "#dd8452", "#c7d3e3"],
            step="post",
        )
        top.set_ylim(0, max(trace.capacity, 1))
        top.set_ylabel("request rows")
        twin = top.twinx()
        twin.plot(t, waiters, color="#222222", linewidth=0.8, label="alloc waiters")
        twin.set_ylabel("tasks waiting in pool.alloc")
        twin.set_ylim(bottom=0)
        handles, labels = top.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        top.legend(handles + h2, labels + l2, loc="upper right", fontsize="small")
    top.set_xlabel("time (s)")
    top.set_title(
        f"scheduler_demo {label}: {report.completed}/{report.requests} requests, "
        f"{report.tokens_per_s:,.0f} tok/s, {report.retractions} retractions, "
        f"{report.deferred_frees} deferred frees, {report.corruptions} corruptions"
    )

    waits_ms = [w * 1e3 for w in trace.alloc_waits]
    if waits_ms:
        bottom.hist(waits_ms, bins=60, color="#55a868")
        bottom.axvline(report.alloc_wait_p50_ms, color="k", linestyle="--", label="p50")
        bottom.axvline(report.alloc_wait_p99_ms, color="r", linestyle="--", label="p99")
        bottom.legend(fontsize="small")
        bottom.set_yscale("log")
    bottom.set_xlabel("pool.alloc wait (ms)")
    bottom.set_ylabel("allocations")
    bottom.set_title("admission wait time (backpressure)")

    fig.savefig(path, format="png", dpi=100)
