"""``run_demo(config) -> Report``: one run, inside the caller's event loop."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool

from .config import DemoConfig
from .forward import Forward
from .report import Report, Trace, percentile
from .scheduler import Scheduler
from .workload import generate

__all__ = ["run_demo"]

logger = logging.getLogger(__name__)


async def run_demo(config: DemoConfig | None = None) -> Report:
    """Run the demo once and return its :class:`Report`.

    Creates the forward stream and the pool in the running loop (the pool is
    loop-affine), serves the whole workload, drains the pool, closes both.
    """
    cfg = config or DemoConfig()
    cfg.validate()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    specs = generate(cfg.workload())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the main thread's ops are tiny; leave the cores to the two loops
    forward = Forward(cfg.device, cfg.forward_ms, cfg.forward_us_per_token)
    bar = _progress_bar(cfg)
    try:
        forward.calibrate()
        # On CUDA the pool resets rows on the forward stream, ordered after
        # every step; unsafe, it resets them on the current stream, as the
        # seed does, racing the forward.
        pool_stream: Any = forward.stream if (forward.is_cuda and not cfg.unsafe) else None
        async with AsyncReqToTokenPool(
            cfg.rows + 1, cfg.max_context_len, device=cfg.device, stream=pool_stream
        ) as pool:
            forward.attach(pool.req_to_token, pool.verified_lens)
            busy0 = forward.busy_s
            on_complete = None if bar is None else bar.update
            sched = Scheduler(cfg, pool, forward, specs, on_complete=on_complete)
            if cfg.timeout_s is not None:
                await asyncio.wait_for(sched.run(), cfg.timeout_s)
            else:
                await sched.run()
            await pool.drain()
            pool.check_invariants()
            stats = pool.stats()
            busy = forward.busy_s - busy0
    finally:
        if bar is not None:
            bar.close()
        forward.close()
        torch.set_num_threads(threads)

    elapsed = max(sched.elapsed, 1e-9)
    steps = max(sched.steps, 1)
    report = Report(
        mode=cfg.mode,
        unsafe=cfg.unsafe,
        device=cfg.device,
        requests=len(specs),
        completed=sched.completed,
        output_tokens=sched.output_tokens,
        computed_tokens=sched.computed_tokens,
        elapsed_s=elapsed,
        tokens_per_s=sched.output_tokens / elapsed,
        steps=sched.steps,
        steps_per_s=sched.steps / elapsed,
        mean_batch_size=sched.batch_total / steps,
        alloc_wait_p50_ms=percentile(sched.alloc_waits, 50) * 1e3,
        alloc_wait_p99_ms=percentile(sched.alloc_waits, 99) * 1e3,
        retractions=sched.retractions,
        deferred_frees=stats.deferred_frees,
        fence_latency_p50_ms=stats.fence_latency.p50_s * 1e3,
        fence_latency_p99_ms=stats.fence_latency.p99_s * 1e3,
        corruptions=sched.corruptions,
        mismatches=sched.mismatches,
        peak_allocated=stats.peak_allocated,
        forward_busy=0.0 if forward.is_cuda else min(1.0, busy / elapsed),
        forward_ms_per_step=0.0 if forward.is_cuda else busy / steps * 1e3,
        sched_cpu_ms_per_step=sched.cpu_s / steps * 1e3,
        config=cfg.to_dict(),
        trace=Trace(sched.timeline, sched.alloc_waits, stats.capacity),
    )
    logger.info(
        "%s%s: %d/%d requests in %.2fs, %d corruptions",
        cfg.mode,
        " unsafe" if cfg.unsafe else "",
        report.completed,
        report.requests,
        elapsed,
        report.corruptions,
    )
    return report


def _progress_bar(cfg: DemoConfig) -> Any:
    if not cfg.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=cfg.num_requests,
        desc=f"{cfg.mode}{' unsafe' if cfg.unsafe else ''}",
        unit="req",
        file=sys.stderr,
        mininterval=0.25,
        leave=False,
    )
