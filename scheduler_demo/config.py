"""The demo's knobs, with the defaults that ``python -m scheduler_demo`` uses."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .workload import LengthDist, WorkloadConfig

__all__ = ["ADMISSIONS", "DemoConfig", "swa_pages_for"]

MEMORY_CAP_BYTES = 4 * 2**30  # the demo's big tables, in all
MAX_REQUESTS = 10_000_000
MAX_SWA_PAGES = 10_000_000
MODES = ("overlap", "sync")
DEVICES = ("cpu", "cuda")
ADMISSIONS = ("atomic", "row-first")
#: The most a step's fixed time, the scheduler's busy time per step and a
#: transfer's mean time may be, in ms: a minute. More can only hang the run
#: (``sched_ms`` busy-waits on the event loop's thread, where not even a
#: timeout can interrupt it).
MAX_MS = 60_000.0
#: The most ``forward_us_per_token`` may be: 10 ms a token (a 512-token
#: prefill step then takes 5 s).
MAX_US_PER_TOKEN = 10_000.0


def swa_pages_for(window: int, page_size: int, rows: int) -> int:
    """The swa group's derived size: for each row, the pages a window of
    ``window`` tokens spans (``ceil(window / page_size)``, plus one when it
    straddles a boundary), plus the page the step in flight may still read
    once it slid out (dropped behind the step's fence)."""
    return rows * (-(-window // page_size) + 2)


@dataclass(frozen=True)
class DemoConfig:
    """Everything one demo run depends on. The defaults are the default run.

    Workload: ``num_requests`` requests with Poisson arrivals at ``rate`` per
    second (0: all at once), lengths drawn from ``prompt_len`` and
    ``output_len`` (see :class:`~scheduler_demo.workload.LengthDist`), and a
    fraction ``abort_rate`` of them aborted by their client (half while their
    prompt's KV is still being transferred, half while decoding), seeded.

    Engine: a pool of ``rows`` request rows (plus padding row 0) of
    ``max_context_len`` columns, and a paged KV cache of ``kv_pages`` pages of
    ``page_size`` token slots (plus padding page 0). A new request's prompt
    KV arrives by a transfer that takes ``transfer_ms`` on average (a quarter
    latency, the rest in proportion to the prompt's length); it joins the batch when the
    transfer has landed. Requests are admitted while the pages held stay
    under ``admit_watermark`` of the cache, keeping a page per
    ``page_size`` running requests spare for decode growth; when a running
    request needs a page and none is free, requests are retracted (freed,
    re-queued at a higher priority, recomputed later by a prefill of at most
    ``max_prefill_tokens`` per step; one retracted before its first token
    has been produced fetches its prompt's KV again by a transfer, so there
    can be more prompt KV transfers than requests). ``admission="atomic"`` admits a row and
    its pages together (``pool.admit``); ``"row-first"`` takes a row at
    arrival and its pages when the budget allows (hold-and-wait).

    Timing: a forward step costs ``forward_ms`` plus ``forward_us_per_token``
    per computed token (real torch compute on the stream), and the scheduler
    spends ``sched_ms`` of busy CPU per step besides its real bookkeeping.
    ``gate`` makes the late writes deterministic (used by the tests): each
    step's table writes wait until the scheduler has finished its next
    iteration, and an aborted request's transfer lands only once a new owner
    of its pages has written and verified a slot it writes (fenced, when the
    scheduler would otherwise idle: its pages are held behind it); with a
    sliding window, a transfer that writes a slot a held step reads in its
    window lands before the step reads it (the forward slower than the
    transfers).

    Hybrid model (``swa_window`` > 0 tokens; 0, the default, is off): the
    pool gets a second KV group, ``"swa"`` (sliding-window layers), of
    ``swa_pages`` pages (0: :func:`swa_pages_for`, room for every row's
    window; given or derived, at most ``MAX_SWA_PAGES``), beside
    ``"full"`` (the ``kv_pages`` above); see :mod:`scheduler_demo.hybrid`.
    """

    num_requests: int = 1500
    rate: float = 200.0
    prompt_len: str = "uniform:32:320"
    output_len: str = "lognormal:96:0.5"
    abort_rate: float = 0.05
    seed: int = 0

    rows: int = 64
    max_context_len: int = 1024
    kv_pages: int = 512
    page_size: int = 16
    admit_watermark: float = 0.99
    max_prefill_tokens: int = 512
    admission: str = "atomic"
    transfer_ms: float = 25.0
    swa_window: int = 0
    swa_pages: int = 0

    mode: str = "overlap"
    unsafe: bool = False
    device: str = "cpu"

    forward_ms: float = 2.5
    forward_us_per_token: float = 3.0
    sched_ms: float = 2.5
    gate: bool = False

    progress: bool = True
    timeout_s: float | None = None

    def validate(self) -> None:
        """Raise ValueError on a knob that cannot work."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.rows < 1:
            raise ValueError("rows must be >= 1")
        if self.max_context_len < 4:
            raise ValueError("max_context_len must be >= 4")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.kv_pages < 1:
            raise ValueError("kv_pages must be >= 1")
        if self.kv_pages * self.page_size < self.max_context_len:
            raise ValueError(
                f"kv_pages * page_size ({self.kv_pages * self.page_size} token slots) must "
                f"be >= max_context_len ({self.max_context_len}) so that any single request fits"
            )
        self._validate_swa()
        if not 0.0 < self.admit_watermark <= 1.0:
            raise ValueError("admit_watermark must be in (0, 1]")
        if not 0.0 <= self.abort_rate <= 1.0:
            raise ValueError("abort_rate must be in [0, 1]")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        # NaN passes every comparison above and below as False, and inf
        # hangs or overflows later: every float must be finite first.
        for name in (
            "rate",
            "abort_rate",
            "admit_watermark",
            "transfer_ms",
            "forward_ms",
            "forward_us_per_token",
            "sched_ms",
            "timeout_s",
        ):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        for name in ("forward_ms", "forward_us_per_token", "sched_ms", "rate", "transfer_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("forward_ms", "sched_ms", "transfer_ms"):
            if getattr(self, name) > MAX_MS:
                raise ValueError(f"{name} must be <= {MAX_MS:g} (a minute)")
        if self.forward_us_per_token > MAX_US_PER_TOKEN:
            raise ValueError(f"forward_us_per_token must be <= {MAX_US_PER_TOKEN:g}")
        if self.gate and self.device != "cpu":
            raise ValueError("gate needs device 'cpu' (it blocks the HostStream's worker)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        # The big buffers (req_to_token, its host mirror, the KV stand-in),
        # checked before any is made: past the cap the demo would swap for
        # minutes before failing with a raw MemoryError.
        need = (self.rows + 1) * self.max_context_len * (4 + 8) + (
            self.kv_pages + 1
        ) * self.page_size * 8
        if self.swa_window:  # its KV and the host's mirror of its slots
            need += (self.swa_capacity + 1) * self.page_size * 8
            need += (self.rows + 1) * self.max_context_len * 8
        if need > MEMORY_CAP_BYTES:
            raise ValueError(
                f"rows x max_context_len and kv_pages x page_size need about "
                f"{need / 2**30:.1f} GiB of tables; the demo caps them at "
                f"{MEMORY_CAP_BYTES / 2**30:.0f} GiB"
            )
        if self.num_requests > MAX_REQUESTS:
            raise ValueError(f"num_requests must be <= {MAX_REQUESTS:,}")
        for name in ("prompt_len", "output_len"):
            try:
                LengthDist.parse(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None

    def _validate_swa(self) -> None:
        if self.swa_window < 0 or self.swa_pages < 0:
            raise ValueError("swa_window and swa_pages must be >= 0 (0: off / derived)")
        if not self.swa_window:
            if self.swa_pages:
                raise ValueError("swa_pages needs swa_window (the sliding-window group)")
            return
        if self.swa_window >= self.max_context_len - 2:
            raise ValueError(
                f"swa_window ({self.swa_window}) must be under max_context_len - 2 "
                f"({self.max_context_len - 2}, the longest request): nothing would slide out"
            )
        least = swa_pages_for(self.swa_window, self.page_size, 1)
        if self.swa_pages and self.swa_pages < least:
            raise ValueError(
                f"swa_pages ({self.swa_pages}) must be >= {least} (a window's pages, "
                f"one of growth and one behind the step's fence) so that any single "
                f"request fits"
            )
        if self.swa_pages > MAX_SWA_PAGES:
            raise ValueError(f"swa_pages must be <= {MAX_SWA_PAGES:,}")
        derived = self.swa_capacity
        if derived > MAX_SWA_PAGES:
            # The same cap as a size given: 0 derives no more than may be asked.
            raise ValueError(
                f"swa_pages 0 derives {derived:,} pages (rows x (ceil(swa_window / "
                f"page_size) + 2)), past the {MAX_SWA_PAGES:,} allowed: give swa_pages"
            )

    @property
    def swa_capacity(self) -> int:
        """The swa group's pages (0 without a window), derived when ``swa_pages`` is 0."""
        if not self.swa_window:
            return 0
        return self.swa_pages or swa_pages_for(self.swa_window, self.page_size, self.rows)

    def workload(self) -> WorkloadConfig:
        # Leave two columns spare: under overlap a request runs one step past
        # its last token before the scheduler learns that it finished.
        return WorkloadConfig(
            num_requests=self.num_requests,
            rate=self.rate,
            prompt_len=LengthDist.parse(self.prompt_len),
            output_len=LengthDist.parse(self.output_len),
            max_total_len=self.max_context_len - 2,
            seed=self.seed,
            abort_rate=self.abort_rate,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
