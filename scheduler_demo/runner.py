"""``run_demo(config) -> Report``: one run, inside the caller's event loop."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool

from .config import DemoConfig
from .forward import Forward
from .report import Report, Trace, percentile, swa_figures
from .scheduler import Scheduler
from .transfer import TransferEngine
from .workload import generate

__all__ = ["run_demo"]

logger = logging.getLogger(__name__)


async def run_demo(
    config: DemoConfig | None = None,
    *,
    reclaim: str = "auto",
    scheduler_factory: Callable[..., Scheduler] = Scheduler,
) -> Report:
    """Run the demo once and return its :class:`Report`.

    Creates the forward and transfer streams, the KV pages and the pool in
    the running loop (the pool is loop-affine), serves the whole workload,
    lands every transfer, drains the pool, closes everything. ``reclaim``
    and ``scheduler_factory`` are for ``--tp`` (:mod:`scheduler_demo.tp`):
    explicit pools and a replicated scheduler.
    """
    cfg = config or DemoConfig()
    cfg.validate()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    specs = generate(cfg.workload())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the main thread's ops are tiny; leave the cores to the two loops
    forward = Forward(cfg.device, cfg.forward_ms, cfg.forward_us_per_token)
    mean_prompt = sum(s.prompt_len for s in specs) / len(specs)
    transfers = TransferEngine(cfg.device, cfg.transfer_ms, mean_prompt)
    bar = _progress_bar(cfg)
    try:
        forward.calibrate()
        # On CUDA the pool resets rows on the forward stream, ordered after
        # every step; unsafe, it resets them on the current stream, as the
        # seed does, racing the forward.
        pool_stream: Any = forward.stream if (forward.is_cuda and not cfg.unsafe) else None
        # The pool owns the pages: a row and its pages are admitted, extended
        # and freed together.
        kv_pages = KVPagePool(cfg.kv_pages + 1, cfg.page_size, device=cfg.device, reclaim=reclaim)
        # A hybrid model's sliding-window group, sized for windows (its slots
        # follow the full group's in the KV tensor).
        swa_pages = None
        groups: Any = kv_pages
        if cfg.swa_window:
            swa_pages = KVPagePool(
                cfg.swa_capacity + 1, cfg.page_size, device=cfg.device, reclaim=reclaim, name="swa"
            )
            groups = {"full": kv_pages, "swa": swa_pages}
        # The KV cache: one value per token slot (page p, offset o at p * page_size + o).
        slots = kv_pages.num_pages + (0 if swa_pages is None else swa_pages.num_pages)
        kv = torch.zeros(slots * cfg.page_size, dtype=torch.int64, device=cfg.device)
        async with AsyncReqToTokenPool(
            cfg.rows + 1,
            cfg.max_context_len,
            device=cfg.device,
            stream=pool_stream,
            kv=groups,
            reclaim=reclaim,
        ) as pool:
            forward.attach(pool.req_to_token, pool.verified_lens, kv)
            transfers.attach(kv)
            if forward.is_cuda:
                torch.cuda.synchronize()  # the zeroed KV and tables land before any stream writes
            busy0 = forward.busy_s
            on_complete = None if bar is None else bar.update
            sched = scheduler_factory(
                cfg, pool, kv_pages, forward, transfers, specs, on_complete=on_complete
            )
            try:
                if cfg.timeout_s is not None:
                    await asyncio.wait_for(sched.run(), cfg.timeout_s)
                else:
                    await sched.run()
            except BaseException:
                # Given up (--timeout, Ctrl-C): no step still queued or
                # running needs its compute, only its writes.
                forward.abandon()
                raise
            finally:
                # Nothing may stay in flight: land every transfer, then drain.
                transfers.flush()
                transfers.synchronize()
            await pool.drain()
            pool.check_invariants()
            kv_pages.check_invariants()
            stats = pool.stats()
            busy = forward.busy_s - busy0
            deferred_pages = kv_pages.stats().deferred_frees
            swa = None if swa_pages is None else swa_figures(sched, swa_pages)
    finally:
        if bar is not None:
            bar.close()
        forward.close()
        transfers.close()
        torch.set_num_threads(threads)

    elapsed = max(sched.elapsed, 1e-9)
    steps = max(sched.steps, 1)
    tl = sched.timeline
    mean_rows = sum(s.allocated for s in tl) / max(len(tl), 1)
    mean_batch = sched.batch_total / steps
    # Utilization from the same samples on both sides (per-step batches over
    # per-iteration rows read 1.01 in sync mode): running over allocated.
    running_rows = sum(s.running for s in tl) / max(len(tl), 1)
    report = Report(
        mode=cfg.mode,
        unsafe=cfg.unsafe,
        device=cfg.device,
        admission=cfg.admission,
        requests=len(specs),
        completed=sched.completed,
        aborts=sched.aborted,
        aborts_in_transfer=sched.aborts_in_transfer,
        aborts_in_decode=sched.aborts_in_decode,
        output_tokens=sched.output_tokens,
        computed_tokens=sched.computed_tokens,
        elapsed_s=elapsed,
        tokens_per_s=sched.output_tokens / elapsed,
        steps=sched.steps,
        steps_per_s=sched.steps / elapsed,
        mean_batch_size=mean_batch,
        alloc_wait_p50_ms=percentile(sched.admit_waits, 50) * 1e3,
        alloc_wait_p99_ms=percentile(sched.admit_waits, 99) * 1e3,
        retractions=sched.retractions,
        deferred_frees=stats.deferred_frees,
        deferred_page_frees=deferred_pages,
        fence_latency_p50_ms=stats.fence_latency.p50_s * 1e3,
        fence_latency_p99_ms=stats.fence_latency.p99_s * 1e3,
        corruptions=sched.corruptions,
        mismatches=sched.mismatches,
        kv_corruptions=sched.kv_corruptions,
        kv_mismatches=sched.kv_mismatches,
        peak_allocated=stats.peak_allocated,
        row_utilization=running_rows / mean_rows if mean_rows else 0.0,
        mean_rows_allocated=mean_rows,
        mean_pages_allocated=sum(s.pages_allocated for s in tl) / max(len(tl), 1),
        transfer_ms=cfg.transfer_ms,
        transfers=transfers.started,
        stalls=sched.stalls,
        forward_busy=min(1.0, busy / elapsed),
        forward_ms_per_step=busy / steps * 1e3,
        sched_cpu_ms_per_step=sched.cpu_s / steps * 1e3,
        config=cfg.to_dict(),
        swa=swa,
        trace=Trace(
            sched.timeline,
            sched.admit_waits,
            stats.capacity,
            kv_pages.capacity,
            sched.abort_times,
        ),
    )
    logger.info(
        "%s%s %s: %d/%d requests (%d aborted) in %.2fs, %d row / %d kv corruptions",
        cfg.mode,
        " unsafe" if cfg.unsafe else "",
        cfg.admission,
        report.completed,
        report.requests,
        report.aborts,
        elapsed,
        report.corruptions,
        report.kv_corruptions,
    )
    return report


def _progress_bar(cfg: DemoConfig) -> Any:
    if not cfg.progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # installed without the demo extra: no bar, same run
        logger.info("no progress bar: tqdm is not installed (pip install 'asyncpool[demo]')")
        return None

    return tqdm(
        total=cfg.num_requests,
        desc=f"{cfg.mode}{' unsafe' if cfg.unsafe else ''}",
        unit="req",
        file=sys.stderr,
        mininterval=0.25,
        leave=False,
    )
