"""The run's figures: a :class:`Report`, its table and its JSON form."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Report", "Sample", "Trace", "percentile"]


class Sample(NamedTuple):
    """The pool and the scheduler at one scheduler iteration."""

    t_s: float  # since the run started
    allocated: int  # rows owned by a request
    pending: int  # rows freed but held behind a fence
    free: int
    waiters: int  # tasks queued in pool.alloc
    running: int  # requests in the batch
    kv_used: int  # simulated KV tokens in use
    retractions: int  # so far
    completed: int  # so far


@dataclass
class Trace:
    """Time series for the plot; not part of the JSON.

    ``timeline``: one :class:`Sample` per scheduler iteration.
    ``alloc_waits``: seconds each ``pool.alloc`` took (0 when granted at once).
    """

    timeline: list[Sample] = field(default_factory=list)
    alloc_waits: list[float] = field(default_factory=list)
    capacity: int = 0


@dataclass
class Report:
    """What one run measured. ``corruptions`` counts requests whose device
    state disagreed with the host's truth at least once; ``mismatches`` counts
    every disagreeing check."""

    mode: str
    unsafe: bool
    device: str
    requests: int
    completed: int
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
    fence_latency_p50_ms: float
    fence_latency_p99_ms: float
    corruptions: int
    mismatches: int
    peak_allocated: int
    forward_busy: float  # fraction of the run the forward worker spent in steps (CPU only)
    forward_ms_per_step: float  # mean wall time of a step on the forward worker (CPU only)
    sched_cpu_ms_per_step: float  # the event loop thread's CPU time per step
    config: dict[str, Any] = field(default_factory=dict)
    trace: Trace = field(default_factory=Trace, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """A safe run that completed every request with no corruption."""
        return not self.unsafe and self.corruptions == 0 and self.completed == self.requests

    def to_dict(self) -> dict[str, Any]:
        """The JSON fields: every scalar field and the config, not the trace."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        out["config"] = dict(self.config)
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> str:
        """A human-readable summary table."""
        label = f"{self.mode}{' --unsafe' if self.unsafe else ' (fenced)'} on {self.device}"
        rows = [
            ("requests completed", f"{self.completed} / {self.requests}"),
            ("elapsed", f"{self.elapsed_s:.2f} s"),
            ("tokens/s (output)", f"{self.tokens_per_s:,.0f}"),
            ("steps/s", f"{self.steps_per_s:,.1f}"),
            ("mean batch size", f"{self.mean_batch_size:.1f}"),
            (
                "alloc wait p50 / p99",
                f"{self.alloc_wait_p50_ms:.2f} / {self.alloc_wait_p99_ms:.2f} ms",
            ),
            ("retractions", f"{self.retractions}"),
            ("deferred frees", f"{self.deferred_frees}"),
            (
                "fence latency p50 / p99",
                f"{self.fence_latency_p50_ms:.2f} / {self.fence_latency_p99_ms:.2f} ms",
            ),
            ("peak rows allocated", f"{self.peak_allocated} / {self.config.get('rows', '?')}"),
            (
                "per step: forward / scheduler CPU",
                f"{self.forward_ms_per_step:.2f} / {self.sched_cpu_ms_per_step:.2f} ms",
            ),
            ("forward stream busy", f"{100 * self.forward_busy:.0f} %"),
            (
                "corruptions",
                f"{self.corruptions}"
                + (f" ({self.mismatches} mismatches)" if self.mismatches else ""),
            ),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"scheduler_demo: {label}", "-" * (width + 24)]
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines)


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; 0.0 for no samples."""
    if not samples:
        return 0.0
    s = sorted(samples)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
