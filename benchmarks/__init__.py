"""Benchmarks for asyncpool (issue 6).

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``); ``--quick``
for a short run, ``--json PATH`` for every sample. Each benchmark is a
coroutine function taking a :class:`~benchmarks.harness.Config`, so the
smoke tests (and ``scripts/gpu_check.sh``) can await it on any loop.
"""

from .harness import PRESETS, Config, Row, Target

__all__ = ["PRESETS", "Config", "Row", "Target"]
