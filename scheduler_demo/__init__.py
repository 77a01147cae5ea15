"""scheduler_demo: an overlap scheduler on uvloop that shows the request-slot
reuse hazard of overlap scheduling and asyncpool's fix.

``python -m scheduler_demo --help`` explains every knob; from async code,
``await run_demo(DemoConfig(...))`` returns a :class:`Report`.
"""

from .config import DemoConfig
from .report import Report, Trace
from .runner import run_demo

__all__ = ["DemoConfig", "Report", "Trace", "main", "run_demo"]


def main(argv: list[str] | None = None) -> int:
    """The command line (see :func:`scheduler_demo.cli.main`)."""
    from .cli import main as _main

    return _main(argv)
