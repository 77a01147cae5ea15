"""Issue 9, "Speed": the cost of ``alloc(n)`` + ``free`` of KV-cache pages.

One cycle is ``pages = pool.alloc(n); pool.free(pages)`` for n = 1, 16 and
256 pages of 16 token slots, on a 32,768-page pool (page 0 reserved, so
32,767 allocatable) of which half was allocated at setup and stays held, so
the free lists are mid-sized as in a busy engine. Each contender is timed
in the same process, interleaved round by round with the order rotated (the
harness's :func:`~benchmarks.harness.interleave`):

* ``asyncpool.KVPagePool``: ``alloc(n)`` returns a 1-D int64 tensor of page
  ids, ``free(pages)`` takes that very tensor back (no fence, so free at
  once): the pool remembers the tensors it hands out, so only "still
  allocated" is checked, as for a row's own pages in ``pool.free([row])``.
  For context it is also freed as a copy (``free(pages.clone())``, the
  clone's 1.3 us included): the fully checked path that ids read back from
  ``req_to_token`` or sliced from a larger tensor take.
* The seed-style pool of :mod:`benchmarks.naive_pages`: a torch free-list
  tensor sliced on alloc and concatenated on free, in the manner of SGLang's
  allocator. Always present, so the table always has a peer.
* SGLang's ``PagedTokenToKVPoolAllocator`` on CPU (``need_sort=False``, the
  unsorted path): ``alloc(n * page_size)`` returns token slot ids, taken
  back two ways: ``free_segment(slots, start_pos=0)``, the path its engine
  frees a finished request's KV by (``release_kv_cache`` -> ``free_kv_row``
  -> ``free_segment``: one slot a page, no ``torch.unique``), where the
  targets are; and ``free(slots)`` (``torch.unique`` of the pages inside),
  for context. Also, for context, the same allocator built with
  ``need_sort=True``, the setting SGLang's engine picks in disaggregated
  prefill or decode mode (``kv_cache_configurator.py``: ``need_sort =
  disaggregation_mode in ("decode", "prefill")``), the setting of a decode
  engine like this project's demo: ``free`` stages the pages in a list
  instead of ``torch.cat`` of the whole free list, and ``alloc`` merges and
  sorts the staged pages when it runs short. Given back by ``free_segment``.
* vLLM's ``BlockPool`` with prefix caching off: ``get_new_blocks(n)`` +
  ``free_blocks(blocks)``, where the vLLM targets are. ``KVPagePool`` has no
  prefix cache, so this is vLLM doing the work ours does, and it is vLLM's
  faster setting. It is not vLLM's default: its engine turns prefix caching
  on for generative models (``CacheConfig.enable_prefix_caching = True``),
  and then ``get_new_blocks`` also runs ``_maybe_evict_cached_block`` on
  every block it hands out. For context that setting is measured too
  (``enable_caching=True``), on blocks that were never hashed: the least it
  costs, since handing out a block that still holds a cached prefix also
  pops its hashes from the cache's map. vLLM's side ends at the list of
  ``KVCacheBlock`` objects (ref counts kept, the free-block queue a doubly
  linked list); the block ids its engine then reads from them
  (``KVCacheBlocks.get_block_ids``) are not timed, where ``KVPagePool``
  hands out the id tensor itself: this favours vLLM. The pool is the layer
  compared here, ours against its; what vLLM's scheduler calls per request,
  ``KVCacheManager.allocate_slots``, is compared with ``extend_rows`` in
  :mod:`benchmarks.bench_decode`.

The two peers are imported when installed and skipped, with the reason and
the install line, when not: they live in a venv of their own
(``benchmarks/install_peers.sh``), never in the project's CI venv.

Everything here is synchronous, so this benchmark does not depend on the
event loop: the runner runs it once (on the first loop) and its rows carry
``loop="sync"``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .harness import Config, Row, Sampler, Target, clock_of, compare, interleave

__all__ = ["INSTALL_HINT", "LOOP", "bench_name", "bench_pages", "load_peer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: what the ``loop`` column says for these loop-independent rows
LOOP = "sync"
INSTALL_HINT = (
    "install it with `bash benchmarks/install_peers.sh VENV` and run the "
    "benchmarks with `VENV/bin/python -m benchmarks` (docs/benchmarks.md)"
)

SUBJECT = "KVPagePool"
SUBJECT_COPY = "KVPagePool, freed as a copy"
SEED = "seed-style"
SGLANG = "SGLang"
SGLANG_UNIQUE = "SGLang free()"
SGLANG_SORTED = "SGLang need_sort"
VLLM = "vLLM"
VLLM_CACHING = "vLLM prefix caching"

#: (peer, n) -> target on the ratio that :func:`_rows` reports for that pair
TARGETS: dict[tuple[str, int], Target] = {
    (SGLANG, 256): Target(">=", 10.0),
    (SGLANG, 16): Target(">=", 5.0),
    (VLLM, 256): Target(">=", 5.0),
    (VLLM, 1): Target("<=", 3.0),  # a cost ratio: within 3x of vLLM at one page
}
#: KVPagePool's cost at the largest n against the middle one (256 vs 16)
FLATNESS = Target("<=", 2.0)


def bench_name(n: int) -> str:
    """The ``bench`` column of the rows for ``alloc(n)`` (the report parses it)."""
    return f"KV pages alloc({n})+free"


@dataclass
class Contender:
    """One allocator under test, reduced to what a cycle needs."""

    key: str
    label: str
    alloc: Callable[[int], Any]
    free: Callable[[Any], Any]
    #: the argument ``alloc`` takes for one page (SGLang counts token slots)
    per_page: int
    #: pages in what ``alloc`` returned
    count: Callable[[Any], int]
    #: pages free right now
    available: Callable[[], int]

    def check_cycle(self, n: int) -> None:
        """One untimed cycle that proves ``alloc`` grants ``n`` pages."""
        before = self.available()
        got = self.alloc(n * self.per_page)
        if got is None or self.count(got) != n:
            raise AssertionError(f"{self.label}: alloc of {n} pages returned {got!r}")
        self.free(got)
        if self.available() != before:
            raise AssertionError(
                f"{self.label}: {before} pages free before a cycle, {self.available()} after"
            )

    def sampler(self, n: int, now: Callable[[], int]) -> Sampler:
        """Times ``reps`` cycles of ``alloc(n)`` + ``free``."""
        alloc, free, arg = self.alloc, self.free, n * self.per_page

        async def sample(reps: int) -> int:
            t0 = now()
            for _ in range(reps):
                free(alloc(arg))
            return now() - t0

        return sample


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown version"


def _kvpagepool(num_pages: int, page_size: int) -> Contender:
    from asyncpool import KVPagePool

    pool = KVPagePool(num_pages, page_size, device="cpu")
    return Contender(
        SUBJECT,
        "asyncpool KVPagePool",
        pool.alloc,
        pool.free,
        1,
        lambda t: int(t.numel()),
        pool.available_size,
    )


def _kvpagepool_copy(num_pages: int, page_size: int) -> Contender:
    from asyncpool import KVPagePool

    pool = KVPagePool(num_pages, page_size, device="cpu")
    free = pool.free
    return Contender(
        SUBJECT_COPY,
        "asyncpool KVPagePool, freeing a copy (checked path)",
        pool.alloc,
        lambda t: free(t.clone()),
        1,
        lambda t: int(t.numel()),
        pool.available_size,
    )


def _seed(num_pages: int, page_size: int) -> Contender:
    from .naive_pages import NaivePagePool

    pool = NaivePagePool(num_pages, page_size)
    return Contender(
        SEED,
        "seed-style torch free list",
        pool.alloc,
        pool.free,
        1,
        lambda t: int(t.numel()),
        pool.available_size,
    )


def _sglang_pool(num_pages: int, page_size: int, *, need_sort: bool = False) -> Any:
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    # SGLang's pages are 1 .. size // page_size, page 0 being its padding:
    # (num_pages - 1) * page_size slots give the same 32,767 pages as ours.
    return PagedTokenToKVPoolAllocator(
        size=(num_pages - 1) * page_size,
        page_size=page_size,
        dtype=torch.bfloat16,  # the KV cache's dtype; the allocator never reads it
        device="cpu",
        kvcache=None,
        need_sort=need_sort,
    )


def _sglang(num_pages: int, page_size: int) -> Contender:
    # The engine's path for a finished request: free_segment, one slot a page.
    pool = _sglang_pool(num_pages, page_size)
    free_segment = pool.free_segment
    return Contender(
        SGLANG,
        f"SGLang {_version('sglang')} PagedTokenToKVPoolAllocator, free_segment",
        pool.alloc,
        lambda s: free_segment(s, start_pos=0),
        page_size,
        lambda t: int(t.numel()) // page_size,
        lambda: int(pool.available_size()) // page_size,
    )


def _sglang_unique(num_pages: int, page_size: int) -> Contender:
    pool = _sglang_pool(num_pages, page_size)
    return Contender(
        SGLANG_UNIQUE,
        f"SGLang {_version('sglang')} PagedTokenToKVPoolAllocator, free (torch.unique)",
        pool.alloc,
        pool.free,
        page_size,
        lambda t: int(t.numel()) // page_size,
        lambda: int(pool.available_size()) // page_size,
    )


def _sglang_sorted(num_pages: int, page_size: int) -> Contender:
    # Disaggregated prefill/decode engines build it with need_sort=True:
    # free stages pages in a list, alloc merges and sorts them when short.
    pool = _sglang_pool(num_pages, page_size, need_sort=True)
    free_segment = pool.free_segment
    return Contender(
        SGLANG_SORTED,
        f"SGLang {_version('sglang')} PagedTokenToKVPoolAllocator, need_sort=True "
        "(disaggregated engines), free_segment",
        pool.alloc,
        lambda s: free_segment(s, start_pos=0),
        page_size,
        lambda t: int(t.numel()) // page_size,
        lambda: int(pool.available_size()) // page_size,
    )


def _vllm(num_pages: int, page_size: int, *, enable_caching: bool = False) -> Contender:
    from vllm.v1.core.block_pool import BlockPool

    # Block 0 is vLLM's null block (never handed out), as our page 0.
    pool = BlockPool(
        num_gpu_blocks=num_pages, enable_caching=enable_caching, hash_block_size=page_size
    )
    if enable_caching:
        key, setting = VLLM_CACHING, "prefix caching on, vLLM's default; blocks never hashed"
    else:
        key, setting = VLLM, "prefix caching off"
    return Contender(
        key,
        f"vLLM {_version('vllm')} BlockPool ({setting})",
        pool.get_new_blocks,
        pool.free_blocks,
        1,
        len,
        pool.get_num_free_blocks,
    )


#: peer name -> (module that must be importable, loader)
PEERS: dict[str, tuple[str, Callable[[int, int], Contender]]] = {
    SGLANG: ("sglang", _sglang),
    SGLANG_UNIQUE: ("sglang", _sglang_unique),
    SGLANG_SORTED: ("sglang", _sglang_sorted),
    VLLM: ("vllm", _vllm),
    # vLLM's engine default; context, no target (see the module docstring).
    VLLM_CACHING: ("vllm", functools.partial(_vllm, enable_caching=True)),
}


def load_peer(
    module: str, build: Callable[[], T], bench: str, name: str, hint: str
) -> tuple[T | None, str | None]:
    """``(build(), None)`` when ``module`` imports and the peer builds, else
    ``(None, the line saying why, ending with hint)``: a missing peer and an
    installed but broken one are skips, never failures of the run."""
    if importlib.util.find_spec(module) is None:
        return None, f"skipped: `{module}` is not importable from {sys.executable}; {hint}"
    try:
        return build(), None
    except Exception as exc:  # an installed but broken peer is a skip, said why
        logger.warning("%s benchmark: %s skipped", bench, name, exc_info=True)
        return None, (
            f"skipped: importing or building it failed ({type(exc).__name__}: {exc}); {hint}"
        )


def _load_peers(num_pages: int, page_size: int) -> tuple[list[Contender], dict[str, str]]:
    """The installed peers, and for each missing one the line saying why."""
    found: list[Contender] = []
    skipped: dict[str, str] = {}
    for name, (module, loader) in PEERS.items():
        n_targets = sum(1 for peer, _ in TARGETS if peer == name)
        hint = (f"its {n_targets} targets are not measured; " if n_targets else "") + INSTALL_HINT
        peer, why = load_peer(
            module, functools.partial(loader, num_pages, page_size), "page", name, hint
        )
        if peer is not None:
            found.append(peer)
        else:
            assert why is not None
            skipped[f"pages vs {name}"] = why
    return found, skipped


async def bench_pages(cfg: Config) -> tuple[list[Row], dict[str, str]]:
    """``alloc(n)`` + ``free`` of KV pages: KVPagePool against every peer.

    Returns the rows and, for each peer that is not installed, the line
    the report prints instead of its rows (keyed ``"pages vs <peer>"``).
    """
    num_pages, page_size, counts = cfg.pages_num_pages, cfg.pages_page_size, cfg.pages_counts
    hold = (num_pages - 1) // 2
    if max(counts) > num_pages - 1 - hold:
        raise ValueError(
            f"alloc({max(counts)}) does not fit the free half of a {num_pages}-page pool"
        )
    now = clock_of(cfg)
    peers, skipped = _load_peers(num_pages, page_size)
    contenders = [
        _kvpagepool(num_pages, page_size),
        _kvpagepool_copy(num_pages, page_size),
        _seed(num_pages, page_size),
        *peers,
    ]

    held: dict[str, Any] = {}
    for c in contenders:
        held[c.key] = c.alloc(hold * c.per_page)  # kept for the whole run
        for n in counts:
            c.check_cycle(n)
    samplers = {f"{c.key}/{n}": c.sampler(n, now) for n in counts for c in contenders}
    per_op = await interleave(samplers, rounds=cfg.rounds, target_s=cfg.sample_s)
    for c in contenders:  # every cycle gave back what it took
        if c.available() != num_pages - 1 - hold:
            raise AssertionError(
                f"{c.label}: {c.available()} pages free after the run, "
                f"expected {num_pages - 1 - hold}"
            )
    return _rows(per_op, contenders, counts, num_pages, page_size), skipped


def _rows(
    per_op: dict[str, list[float]],
    contenders: list[Contender],
    counts: tuple[int, ...],
    num_pages: int,
    page_size: int,
) -> list[Row]:
    note = f"{num_pages:,}-page pool, half allocated; {page_size} slots a page"
    subject, copy = contenders[0], contenders[1]
    rows: list[Row] = []
    for n in counts:
        for peer in contenders[1:]:
            target = TARGETS.get((peer.key, n))
            rows.append(
                compare(
                    per_op,
                    bench=bench_name(n),
                    loop=LOOP,
                    subject=f"{subject.key}/{n}",
                    reference=f"{peer.key}/{n}",
                    subject_label=subject.label,
                    reference_label=peer.label,
                    unit="ns/cycle",
                    speedup=target is None or target.op == ">=",
                    target=target,
                    note=note,
                )
            )
        # Context: the checked path against the engines' own paths.
        for peer in contenders[3:]:
            if peer.key in (SGLANG_UNIQUE, SGLANG_SORTED, VLLM_CACHING):
                continue
            rows.append(
                compare(
                    per_op,
                    bench=bench_name(n),
                    loop=LOOP,
                    subject=f"{copy.key}/{n}",
                    reference=f"{peer.key}/{n}",
                    subject_label=copy.label,
                    reference_label=peer.label,
                    unit="ns/cycle",
                    speedup=True,
                    target=None,
                    note=note,
                )
            )
    if 16 in counts and 256 in counts:
        rows.append(
            compare(
                per_op,
                bench="KV pages: alloc(256)+free vs alloc(16)+free",
                loop=LOOP,
                subject=f"{subject.key}/256",
                reference=f"{subject.key}/16",
                subject_label=f"{subject.label}, 256 pages",
                reference_label=f"{subject.label}, 16 pages",
                unit="ns/cycle",
                speedup=False,
                target=FLATNESS,
                note=note,
            )
        )
    return rows
