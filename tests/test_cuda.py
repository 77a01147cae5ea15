"""CUDA checks: events as fences, the pool on a device, the watcher, memory saver.

Every test here is marked ``cuda``; ``conftest.py`` skips them on a machine
without a CUDA device. ``scripts/gpu_check.sh`` runs them on one.

A forward step that is still running is a kernel that spins on the GPU
(``torch.cuda._sleep``), calibrated once to milliseconds, so "the step is
still in flight" holds by hundreds of milliseconds rather than by luck.

Its late writes are kernels (``fill_`` on a view, ``index_fill_``), never
``t[i] = value`` from the host: on CUDA that is a blocking copy, which waits
for the spin and makes the write early (seen on an H200; conftest.py also
loads every kernel at start, since a lazily loaded kernel can synchronise the
context at its first launch).
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import bounded, gpu_busy

from asyncpool import (
    AsyncReqToTokenPool,
    CudaFence,
    Grant,
    KVPagePool,
    PoolBusyError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    record_fence,
    wait_fence,
)

pytestmark = pytest.mark.cuda


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def info(verified: int, alloced: int) -> ReqToTokenPoolInfo:
    return ReqToTokenPoolInfo(
        verified, alloced, torch.arange(1, alloced + 1, dtype=torch.int32, device="cuda")
    )


def _use_torch_hook_mode_unless_preloaded() -> None:
    """torch-memory-saver defaults to LD_PRELOAD hooks; use torch's allocator hooks
    when the process was not started with the preload library."""
    from torch_memory_saver import torch_memory_saver

    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return
    try:
        torch_memory_saver.hook_mode = "torch"
    except (AssertionError, AttributeError):
        pass  # already initialised in this process


# --------------------------------------------------------------------------- fences


def test_cuda_fences_are_ordered_per_stream() -> None:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        gpu_busy(300)
    a = record_fence(s1)
    b = record_fence(s1)
    c = record_fence(s2)
    assert isinstance(a, CudaFence) and isinstance(c, CudaFence)
    assert a.stream_key == b.stream_key != c.stream_key
    assert b.seq == a.seq + 1
    assert not a.query() and not b.query()  # the kernel spins for 300 ms
    b.synchronize()
    assert a.query() and b.query()
    c.synchronize()
    # a torch.Stream of type cuda is accepted too, and maps to the same key
    generic = torch.Stream(
        stream_id=s1.stream_id, device_index=s1.device_index, device_type=s1.device_type
    )
    d = record_fence(generic)
    d.synchronize()
    assert d.stream_key == a.stream_key and d.seq == b.seq + 1


def test_cuda_events_are_pooled_not_recreated() -> None:
    from asyncpool.fences import _event_pool

    s = torch.cuda.Stream()
    for _ in range(4):
        record_fence(s).synchronize()
    gc.collect()
    created = _event_pool.created
    for _ in range(500):
        f = record_fence(s)
        f.synchronize()
        del f
    gc.collect()
    assert _event_pool.created - created <= 2, _event_pool.created - created
    # an event a holder still has is never handed out again
    held = [record_fence(s) for _ in range(8)]
    assert len({id(f.event) for f in held}) == 8
    for f in held:
        f.synchronize()


# --------------------------------------------------------------------------- the pool on CUDA


async def test_pool_waits_for_the_forward_kernel_and_never_shows_its_late_write() -> None:
    fwd = torch.cuda.Stream()
    pool = AsyncReqToTokenPool(5, 64, device="cuda", stream=fwd)
    try:
        async with bounded():
            rows = await pool.alloc(4)
        index = torch.tensor(rows, device="cuda")
        with torch.cuda.stream(fwd):
            gpu_busy(300)  # step t is still running...
            pool.verified_lens.index_fill_(0, index, 7)  # ...and writes the rows late
        step = record_fence(fwd)
        pool.record_use(rows, step)
        assert pool.free(rows) == 0
        assert pool.stats().pending == 4
        assert pool.try_alloc(1) is None
        async with asyncio.timeout(10):
            again = await pool.alloc(4)  # woken by the watcher thread
        # Granted only once the step is done: asked at the grant, with the
        # kernel spinning 300 ms, an early grant finds it still running.
        assert step.query(), "granted while the step still ran"
        with torch.cuda.stream(fwd):  # the next forward reads the rows on the pool's stream
            seen = pool.verified_lens[again].clone()
        fwd.synchronize()
        assert seen.tolist() == [0, 0, 0, 0], seen  # reset, after the late write
        pool.free(again, after=fwd)
        async with asyncio.timeout(10):
            await pool.drain()
        pool.check_invariants()
        st = pool.stats()
        assert st.free == 4 and st.fence_latency.count >= 1
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


async def test_a_copy_behind_the_steps_event_reads_its_write_and_free_after_holds_the_rows() -> (
    None
):
    """docs/cuda.md, *When free(after=stream)*: a copy stream is not ordered
    after the forward; made to wait on the step's event
    (``copy.wait_event(step.event)``) it reads what the step wrote, and
    ``free(rows, after=copy)`` holds the rows until the step and the copy
    have both run."""
    fwd = torch.cuda.Stream()
    copy = torch.cuda.Stream()
    pool = AsyncReqToTokenPool(3, 16, device="cuda", stream=fwd)
    try:
        async with bounded():
            rows = await pool.alloc(2)
        index = torch.tensor(rows, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(fwd):
            gpu_busy(300)  # step t is still running...
            pool.verified_lens.index_fill_(0, index, 7)  # ...and writes the rows late
        step = record_fence(fwd)
        assert isinstance(step, CudaFence)
        pool.record_use(rows, step)
        out = torch.zeros(2, dtype=pool.verified_lens.dtype, pin_memory=True)
        with torch.cuda.stream(copy):
            copy.wait_event(step.event)
            out.copy_(pool.verified_lens.index_select(0, index), non_blocking=True)
        assert pool.free(rows, after=copy) == 0
        assert not step.query()
        assert pool.stats().pending == 2 and pool.try_alloc(1) is None
        async with asyncio.timeout(10):
            again = await pool.alloc(2)  # the step and the copy have run
        assert sorted(again) == sorted(rows)
        copy.synchronize()
        assert out.tolist() == [7, 7], out  # the copy ran after the step's write
        pool.free(again, after=fwd)
        async with asyncio.timeout(10):
            await pool.drain()
        pool.check_invariants()
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


async def test_unfenced_free_lets_the_late_write_corrupt_the_new_owner() -> None:
    """The same scene without record_use: the new owner's row gets step t's write."""
    fwd = torch.cuda.Stream()
    pool = AsyncReqToTokenPool(2, 64, device="cuda")  # resets on the current stream
    try:
        async with bounded():
            (row,) = await pool.alloc(1)
        with torch.cuda.stream(fwd):
            gpu_busy(300)
            pool.verified_lens[row : row + 1].fill_(7)  # step t's late write
        pool.free([row])  # unsafe: no record_use, no fence
        async with bounded():
            (again,) = await pool.alloc(1)  # granted while step t still runs
        assert again == row
        # the new owner's prefill, on the scheduler's stream
        pool.verified_lens[again : again + 1].fill_(3)
        torch.cuda.synchronize()
        assert pool.verified_lens[again].item() == 7, "the late write should have landed"
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


async def test_resets_run_on_the_pools_stream_and_precede_later_writes() -> None:
    pool_stream = torch.cuda.Stream()
    pool = AsyncReqToTokenPool(3, 64, device="cuda", stream=pool_stream)
    try:
        async with bounded():
            rows = await pool.alloc(2)
        pool.set_req_pool_info(rows[0], info(5, 8))
        pool.set_req_pool_info(rows[1], info(6, 8))
        torch.cuda.synchronize()
        pool.free(rows)  # dirty rows, free at once
        with torch.cuda.stream(pool_stream):
            gpu_busy(300)  # hold the pool's stream
        async with bounded():
            again = await pool.alloc(2)  # the bulk reset is queued on the pool's stream
        assert sorted(again) == sorted(rows)
        assert pool.alloced_lens_cpu[again].tolist() == [0, 0]  # host copy: zeroed at once
        # the device reset has not run yet: it waits behind the spin on the pool's stream
        assert sorted(pool.verified_lens[again].tolist()) == [5, 6]
        # the new owner's write must land after the reset, not be clobbered by it
        pool.set_req_pool_info(again[0], info(2, 3))
        torch.cuda.synchronize()
        assert pool.verified_lens[again[0]].item() == 2
        assert pool.alloced_lens[again[0]].item() == 3
        assert pool.verified_lens[again[1]].item() == 0
        assert pool.alloced_lens[again[1]].item() == 0
        pool.free(again)
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


# torch warns that the debug mode is a prototype; the suite's warnings are errors.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
async def test_the_calls_of_a_scheduler_step_never_wait_for_the_stream() -> None:
    """A step's pool calls queue their device work and return: none waits
    for the stream, where the forward step may still be running.

    On the pool's own stream (``stream=``, here the current stream as well)
    a kernel spins for 300 ms; then the calls a scheduler makes while it
    runs: a grant that resets dirty rows, ``set_req_pool_info`` with device
    and host slots, an admission's pages, ``KVPagePool.alloc`` and
    ``slots`` of device and host ids. The spin's fence must still be open
    after them, and torch's sync debug mode turns any synchronising call
    into an error. Before host_to_device, the fill_ writes and slots on the
    GPU, ``set_req_pool_info`` (``t[row] = n``), ``alloc`` and ``slots`` (a
    read-back, a blocking ``.to``) and the resets (a pageable copy) each
    waited.
    """
    fwd = torch.cuda.Stream()
    kv = KVPagePool(65, 4, device="cuda")
    pool = AsyncReqToTokenPool(9, 64, device="cuda", stream=fwd, kv=kv)
    host_slots = torch.arange(1, 9, dtype=torch.int64)

    def step() -> tuple[list[int], Grant, torch.Tensor]:
        rows = pool.try_alloc(2)
        assert rows is not None
        pool.set_req_pool_info(rows[0], info(3, 8))
        pool.set_req_pool_info(rows[1], ReqToTokenPoolInfo(3, 8, host_slots))
        grant = pool.try_admit(pages=4)
        assert grant is not None
        pages = kv.alloc(4)
        assert pages is not None
        kv.slots(grant.pages)  # device ids: computed on the GPU, unread
        kv.slots(pages)
        kv.slots([1, 2])  # host ids: checked, copied through pinned memory
        return rows, grant, pages

    def give_back(rows: list[int], grant: Grant, pages: torch.Tensor) -> None:
        pool.free(rows)  # dirty rows: the next grant resets them
        pool.free([grant.row])
        kv.free(pages)

    try:
        with torch.cuda.stream(fwd):
            give_back(*step())  # warm: kernels, pinned blocks
            torch.cuda.synchronize()
            gpu_busy(300)
            in_flight = record_fence(fwd)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not in_flight.query(), "a pool call waited for the step in flight"
            rows = out[0]
            in_flight.synchronize()
            assert pool.verified_lens[rows].tolist() == [3, 3]
            assert pool.req_to_token[rows[1], :8].tolist() == host_slots.tolist()
            give_back(*out)
        async with bounded():
            await pool.drain()
        pool.check_invariants()
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


async def test_wait_fence_on_a_cuda_event_lets_the_loop_run() -> None:
    """``await wait_fence(event)`` sleeps in a watcher thread, not in the loop."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gpu_busy(200)
    fence = record_fence(stream)
    waiter = asyncio.create_task(wait_fence(fence))
    ran = 0
    while ran < 50 and not fence.query():
        await asyncio.sleep(0)
        ran += 1
    assert ran == 50 and not waiter.done()  # the loop ran while the kernel spun
    async with bounded():
        await waiter
    assert fence.query()


async def test_the_guides_grant_recipe_keeps_its_pages_until_the_forward_read_them() -> None:
    """docs/cuda.md, *KV pages and atomic admission*: ``grant.pages`` is
    made on the grant stream and read on the forward stream behind a step
    in flight (``kv.slots`` there), then dropped; with
    ``grant.pages.record_stream(forward)`` the next grant's ids, copied on
    the grant stream into whatever block the allocator hands it, cannot
    overwrite them before that read."""
    forward = torch.cuda.Stream()
    grant_stream = torch.cuda.current_stream()
    kv = KVPagePool(65, 4, device="cuda")
    pool = AsyncReqToTokenPool(5, 64, device="cuda", stream=forward, kv=kv)
    try:
        torch.cuda.synchronize()
        with torch.cuda.stream(forward):
            gpu_busy(300)  # step t, still running while the scheduler admits
        grant = pool.try_admit(pages=4)
        assert grant is not None
        first = pool.pages_of(grant.row, host=True).tolist()
        with torch.cuda.stream(forward):
            forward.wait_stream(grant_stream)
            slots = kv.slots(grant.pages)  # queued behind the spin
        grant.pages.record_stream(forward)
        row = grant.row
        del grant  # the scheduler lets go of its tensor
        gc.collect()
        second = pool.try_admit(pages=4)  # new ids, copied on the grant stream now
        assert second is not None
        assert pool.pages_of(second.row, host=True).tolist() != first
        forward.synchronize()
        expected = [page * 4 + offset for page in first for offset in range(4)]
        assert slots.tolist() == expected
        pool.free([row, second.row])
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
async def test_host_ids_of_a_cuda_pool_stay_on_the_cpu_and_free_without_a_read_back() -> None:
    kv = KVPagePool(33, 4, device="cuda")
    pool = AsyncReqToTokenPool(4, 64, device="cuda", kv=kv)
    try:
        grant = pool.try_admit(pages=3)
        assert grant is not None and grant.pages.is_cuda
        host = pool.pages_of(grant.row, host=True)
        mine = kv.alloc(2, host=True)
        assert mine is not None and not host.is_cuda and not mine.is_cuda
        assert host.tolist() == grant.pages.tolist()
        detached = pool.detach_pages(grant.row, host=True)
        assert not detached.is_cuda and detached.tolist() == host.tolist()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            kv.slots(detached)  # host ids: checked on the host, copied pinned
            kv.free(detached)  # nothing to read back
            kv.free(mine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        pool.free([grant.row])
        pool.check_invariants()
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


def test_sync_pool_on_cuda_with_fences() -> None:
    fwd = torch.cuda.Stream()
    pool = ReqToTokenPool(9, 32, device="cuda", stream=fwd)
    rows = pool.alloc(8)
    assert rows is not None
    with torch.cuda.stream(fwd):
        gpu_busy(200)
    pool.free(rows, after=fwd)
    assert pool.pending_size() == 8
    assert pool.alloc(1) is None  # pending, not reclaimed before the kernel ends
    fwd.synchronize()
    assert pool.alloc(8) is not None
    pool.check_invariants()


# --------------------------------------------------------------------------- the watcher


async def test_watcher_wake_latency_and_cpu() -> None:
    """The watcher wakes the loop for each of 20 CUDA fences; prints its
    wake latency and the process's CPU while it waits."""
    fwd = torch.cuda.Stream()
    pool = AsyncReqToTokenPool(2, 8, device="cuda")
    latencies: list[float] = []
    cpu_ratio: list[float] = []
    try:
        for _ in range(20):
            async with bounded():
                (row,) = await pool.alloc(1)
            with torch.cuda.stream(fwd):
                gpu_busy(50)
            fence = record_fence(fwd)
            pool.record_use([row], fence)
            pool.free([row])
            stamp: list[float] = []
            # an independent observer blocks on the same event: when did it complete?
            observer = threading.Thread(target=_stamp_when_done, args=(fence, stamp))
            observer.start()
            c0, t0 = cpu_seconds(), time.perf_counter()
            async with asyncio.timeout(10):
                again = await pool.alloc(1)
            t1, c1 = time.perf_counter(), cpu_seconds()
            observer.join(10)
            assert again == [row]
            latencies.append(max(0.0, t1 - stamp[0]))
            cpu_ratio.append((c1 - c0) / max(t1 - t0, 1e-9))
            pool.free(again)
        p50 = statistics.median(latencies)
        worst = max(latencies)
        cpu = statistics.median(cpu_ratio)
        # Figures, not assertions (no timing assertion in a test: a loaded
        # host or a shared GPU would fail it); gpu_check.sh runs with -s and
        # keeps the line in its log. That the watcher's events sleep in the
        # driver (blocking=True) is checked without a clock in
        # test_cuda_paths_on_cpu.py.
        print(
            f"\nwatcher wake latency: p50 {p50 * 1e6:.0f} us, max {worst * 1e6:.0f} us; "
            f"process CPU while waiting: {cpu:.0%} of one core"
        )
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()
    assert not [t for t in threading.enumerate() if t.name == "asyncpool-fence-watcher"]


def _stamp_when_done(fence: CudaFence, stamp: list[float]) -> None:
    fence.synchronize()
    stamp.append(time.perf_counter())


# --------------------------------------------------------------------------- memory saver


async def test_memory_saver_releases_and_resumes_the_kv_cache_region() -> None:
    _use_torch_hook_mode_unless_preloaded()
    size, ctx = 1025, 32768  # req_to_token: 1025 * 32768 * 4 B = 128 MiB
    pool = AsyncReqToTokenPool(size, ctx, device="cuda", enable_memory_saver=True)
    try:
        async with bounded():
            rows = await pool.alloc(2)
        pool.set_req_pool_info(rows[0], info(3, 4))
        pool.write((rows[1], slice(0, 4)), torch.arange(4, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()

        busy = pool.release_memory()
        with pytest.raises(PoolBusyError):
            async with bounded():
                await busy  # rows still allocated: refused, and the pool keeps serving
        assert not pool.released
        pool.free(rows)

        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        async with bounded():
            await pool.release_memory()
        torch.cuda.synchronize()
        free_released = torch.cuda.mem_get_info()[0]
        assert pool.released and pool.stats().released
        gained = free_released - free_before
        assert gained >= 0.5 * size * ctx * 4, f"released only {gained / 2**20:.1f} MiB"

        assert pool.try_alloc(1) is None
        waiter = asyncio.create_task(pool.alloc(1))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done()

        async with bounded():
            await pool.resume_memory()
        async with asyncio.timeout(10):
            granted = await waiter
        torch.cuda.synchronize()
        assert not pool.released
        assert int(torch.count_nonzero(pool.req_to_token).item()) == 0
        assert int(torch.count_nonzero(pool.verified_lens).item()) == 0
        assert int(torch.count_nonzero(pool.alloced_lens).item()) == 0
        # the tables are usable again
        pool.set_req_pool_info(granted[0], info(1, 2))
        torch.cuda.synchronize()
        assert pool.verified_lens[granted[0]].item() == 1
        pool.free(granted)
        pool.check_invariants()
        print(f"\nmemory saver: released {gained / 2**20:.1f} MiB of the kv_cache region")
    finally:
        async with bounded():
            await pool.close()
        torch.cuda.synchronize()


_SAVER_PROCESS = """
import asyncio, gc, torch
from asyncpool import AsyncReqToTokenPool

async def main():
    pool = AsyncReqToTokenPool(64, 4096, device="cuda", enable_memory_saver=True)
    await pool.release_memory()
    await pool.resume_memory()
    await pool.close()

asyncio.run(main())
gc.collect()
torch.cuda.empty_cache()  # the pool is gone; its region's pool is cached, not freed
print("pool dropped", flush=True)
"""


def test_a_process_that_used_the_memory_saver_exits_cleanly() -> None:
    """torch-memory-saver's torch-hook free calls ``exit(1)`` for a free made
    outside a region, and its pools are freed at shutdown, outside any: the
    process exited 1 after a clean run until the adapter's exit guard."""
    proc = subprocess.run(
        [sys.executable, "-c", _SAVER_PROCESS], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert "pool dropped" in proc.stdout, out
    assert "only support interesting region" not in out, out
    assert proc.returncode == 0, out
