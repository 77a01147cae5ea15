"""Issue 6, part 6: the scheduler demo's throughput ratios (placeholder)."""

from __future__ import annotations

from typing import Any

from .harness import Config, Row


def bench_demo(cfg: Config, loops: list[str]) -> tuple[list[Row], dict[str, Any]]:
    return [], {"unavailable": "scheduler_demo not written yet"}
