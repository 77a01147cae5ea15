"""The allocator work of one decode step, against SGLang's and vLLM's.

A decode step adds one token to each of B running requests; a request with
L tokens stored needs a new page for its next token iff ``L % page_size ==
0``. The scenario (:class:`Scenario`, from the preset's ``decode_*``
fields): B = 256 running requests whose stored lengths are drawn
seeded-random in [16, 1024), 16 token slots a page, a 32,768-page pool
(page 0 reserved). A batch is 256 steps from those starting lengths, every
length growing by one a step; over any 16 consecutive steps each request
crosses a page boundary exactly once, so a step hands out B / 16 pages on
average (which requests cross at step j is fixed by the lengths, the same
for every side, and every sample runs whole batches). Between batches,
untimed, each side gives back the pages the batch took and returns to the
starting lengths; only the step calls are timed (one clock read either side
of each step), and after every step, untimed, each side is checked to have
handed out exactly the pages the lengths call for. After the run each pool
holds what it held at the start. A batch is long because asyncpool's row
record grows in a doubling buffer whose first growth after admission takes
the buffer and copies the record (``_append``, about 1.1 us a row more than
a growth inside the buffer; every row pays it once a batch, as a request
does once after admission): at 256 steps (16 new pages a row) that is about
a tenth of its figure, at 64 steps about a third (figures at 64, 256 and
1,024 steps: 14.2, 10.8 and 10.4 us a step on the dev VM).

Two benchmarks, all sides interleaved in one run (the harness's
:func:`~benchmarks.harness.interleave`, order rotated each round):

1. "pages for the requests crossing a page boundary". The list of crossing
   requests is computed before the step is timed, from Python lengths,
   alike for asyncpool and vLLM's ``BlockPool``.

   * asyncpool: ``pool.extend_rows(crossing_rows, 1)`` on an
     ``AsyncReqToTokenPool(B + 1, ..., kv=KVPagePool(32768, 16))`` whose B
     rows were admitted with ``try_admit(pages=ceil(L / 16))``: one take
     for the step, the new pages recorded in each row's record. Between
     batches the rows are freed and admitted again.
   * vLLM ``BlockPool`` (prefix caching off): for each crossing request,
     ``req_blocks[i].extend(block_pool.get_new_blocks(1))``, what
     ``SingleTypeKVCacheManager.allocate_new_blocks`` does once it knows a
     request needs a block, without ``KVCacheManager``'s per-request
     bookkeeping: this favours vLLM. Between batches ``free_blocks`` gives
     back what the batch added.
   * vLLM ``KVCacheManager`` (prefix caching off, one full-attention group),
     the engine's own path: ``allocate_slots(request, 1)`` for each of the
     B running requests, as its scheduler calls it for a decode step. It
     finds the crossing requests itself, where asyncpool is handed them:
     this favours asyncpool. Between steps, untimed, each ``Request``
     advances a token (``num_computed_tokens += 1`` and one output token
     appended); between batches ``free(request)`` and fresh requests
     prefilled to the starting lengths with ``allocate_slots(request, L)``.

2. "every request's new-token KV slot": SGLang's ``out_cache_loc`` (the
   token slot each request's new token is written to).

   * asyncpool, as an engine would compute it, in torch on CPU from the
     stored lengths ``lens_t``, the rows ``rows_t`` and ``last_loc`` (the
     slot of each request's last stored token): ``need = lens_t % 16 == 0;
     idx = need.nonzero().squeeze(1); out = last_loc + 1; if idx.numel():
     pages = pool.extend_rows(rows_t[idx], 1); out[idx] = pages.view(-1) *
     16``. Pool and batches as in 1.
   * SGLang ``PagedTokenToKVPoolAllocator`` on CPU (``need_sort=False``):
     ``alloc_decode(seq_lens, seq_lens_cpu, last_loc)``, where SGLang's
     ``seq_lens`` include the new token (L + 1; one tensor for both
     arguments on CPU). It runs its torch path (``alloc_decode_naive``),
     not the Triton kernel, which SGLang would pick on a CUDA host whatever
     the allocator's device (and which cannot read CPU tensors). The pages of the
     starting lengths are allocated once and held; between batches
     ``free_page_ids`` gives back the pages the batch's steps handed out.

   Both sides start from the same lengths; each side's next ``last_loc`` is
   the step's output. Not timed on either side: the gather an engine does
   for ``last_loc`` and the write of ``out`` into ``req_to_token``.
   asyncpool also records each new page in its row's record (SGLang's
   allocator keeps no per-request record).

Both vLLM sides above run with prefix caching off, vLLM's faster setting
and not its engine's default (on for generative models: ``get_new_blocks``
then also checks each block for a cached prefix to evict, and
``allocate_slots`` caches each request's full blocks); asyncpool has no
prefix cache, so this is the same work, and it favours vLLM. For context,
``KVCacheManager`` is also measured in the default setting
(:class:`VllmManagerCaching`: sha256 block hashes computed untimed as
tokens are appended, each block cached as it fills, cached blocks evicted
as the free queue hands them out).

The rows are context (no targets), ratios oriented as speed-ups (reference
over subject). The peers are imported when installed and skipped, with the
reason and the install line, when not (``benchmarks/install_peers.sh``); the
asyncpool sides run either way. Everything here is synchronous, so the
runner runs it once (on the first loop) and its rows carry ``loop="sync"``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .bench_pages import INSTALL_HINT, LOOP, _sglang_pool, _version, load_peer
from .harness import Config, Row, Sampler, clock_of, compare, interleave

__all__ = ["BENCH_PAGES", "BENCH_SLOTS", "Scenario", "Side", "bench_decode"]

BENCH_PAGES = "decode step: pages for the requests crossing a page boundary"
BENCH_SLOTS = "decode step: every request's new-token KV slot"

ASYNCPOOL_PAGES = "asyncpool pages"
ASYNCPOOL_SLOTS = "asyncpool slots"
VLLM = "vLLM"
VLLM_MANAGER = "vLLM KVCacheManager"
VLLM_MANAGER_CACHING = "vLLM KVCacheManager, prefix caching"
SGLANG = "SGLang"

#: the seed of the starting lengths
LENGTHS_SEED = 20_240_601


@dataclass(frozen=True)
class Scenario:
    """The running requests at the start of every batch of steps."""

    #: tokens already stored, per request
    lens: tuple[int, ...]
    page_size: int
    #: pool size in pages, page 0 included (reserved)
    num_pages: int
    #: steps per batch, from the starting lengths
    steps: int

    @classmethod
    def of(cls, cfg: Config) -> Scenario:
        lo, hi = cfg.decode_lens
        rng = random.Random(LENGTHS_SEED)
        lens = tuple(rng.randrange(lo, hi) for _ in range(cfg.decode_requests))
        sc = cls(lens, cfg.decode_page_size, cfg.decode_num_pages, cfg.decode_batch_steps)
        if sc.steps < 1 or sc.steps % sc.page_size:
            raise ValueError(
                f"decode_batch_steps ({sc.steps}) must be a positive multiple of "
                f"the page size ({sc.page_size})"
            )
        if sum(sc.pages_at(sc.steps)) > sc.num_pages - 1:
            raise ValueError(
                f"{len(lens)} requests of up to {hi + sc.steps} tokens do not fit "
                f"a {sc.num_pages}-page pool"
            )
        return sc

    @property
    def requests(self) -> int:
        return len(self.lens)

    @property
    def max_len(self) -> int:
        """The longest a request gets in a batch (tokens)."""
        return max(self.lens) + self.steps

    def pages_at(self, j: int) -> list[int]:
        """Pages each request holds before step ``j`` of a batch."""
        ps = self.page_size
        return [-(-(n + j) // ps) for n in self.lens]

    def crossing(self, j: int) -> list[int]:
        """The requests (indices) that need a new page at step ``j``."""
        ps = self.page_size
        return [i for i, n in enumerate(self.lens) if (n + j) % ps == 0]

    def lens_tensor(self, j: int = 0) -> torch.Tensor:
        """The stored lengths before step ``j``, int64."""
        return torch.tensor(self.lens, dtype=torch.int64) + j


class Side:
    """One allocator's decode step, and the untimed work around it."""

    key: str
    label: str

    def begin(self) -> Sequence[Any]:
        """Untimed: be at the starting lengths; the argument of each step."""
        raise NotImplementedError

    def step(self, arg: Any) -> object:
        """Timed: one decode step."""
        raise NotImplementedError

    def after(self, j: int) -> None:
        """Untimed, after step ``j``: anything the next step needs."""

    def end(self) -> None:
        """Untimed: give back what the batch's steps took."""
        raise NotImplementedError

    def available(self) -> int:
        """Pages free right now."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release the pool (asyncpool's must close)."""

    def sampler(self, sc: Scenario, now: Callable[[], int]) -> Sampler:
        """Times ``n`` batches of ``sc.steps`` steps each (only the step
        calls); checks every step's page count."""
        expected = [len(sc.crossing(j)) for j in range(sc.steps)]
        begin, step, after, end, available = (
            self.begin,
            self.step,
            self.after,
            self.end,
            self.available,
        )
        label = self.label

        async def sample(n: int) -> int:
            elapsed = 0
            for _ in range(n):
                args = begin()
                for j, arg in enumerate(args):
                    before = available()
                    t0 = now()
                    step(arg)
                    elapsed += now() - t0
                    if before - available() != expected[j]:
                        raise AssertionError(
                            f"{label}: step {j} handed out "
                            f"{before - available()} pages, expected "
                            f"{expected[j]}"
                        )
                    after(j)
                end()
            return elapsed

        return sample


class _Admitted(Side):
    """An ``AsyncReqToTokenPool`` with ``kv=``, its B rows admitted at the
    starting lengths by :meth:`begin` and freed by :meth:`end`."""

    def __init__(self, sc: Scenario) -> None:
        from asyncpool import AsyncReqToTokenPool, KVPagePool

        self.sc = sc
        self.kv = KVPagePool(sc.num_pages, sc.page_size, device="cpu")
        self.pool = AsyncReqToTokenPool(sc.requests + 1, sc.max_len, kv=self.kv)
        self.rows: list[int] = []
        self.extend_rows = self.pool.extend_rows

    def admit(self) -> list[int]:
        try_admit = self.pool.try_admit
        self.rows = []
        for pages in self.sc.pages_at(0):
            grant = try_admit(pages=pages)
            if grant is None:
                raise AssertionError(f"{self.label}: try_admit(pages={pages}) refused")
            self.rows.append(grant.row)
        return self.rows

    def end(self) -> None:
        self.pool.free(self.rows)
        self.rows = []

    def available(self) -> int:
        return self.kv.available_size()

    async def close(self) -> None:
        await self.pool.close()


class AsyncpoolPages(_Admitted):
    """1: ``pool.extend_rows(crossing_rows, 1)``."""

    key = ASYNCPOOL_PAGES
    label = "asyncpool extend_rows(crossing rows, 1)"

    def __init__(self, sc: Scenario) -> None:
        super().__init__(sc)
        self.crossing = [sc.crossing(j) for j in range(sc.steps)]

    def begin(self) -> list[list[int]]:
        rows = self.admit()
        return [[rows[i] for i in idx] for idx in self.crossing]

    def step(self, arg: list[int]) -> object:
        return self.extend_rows(arg, 1)


class AsyncpoolSlots(_Admitted):
    """2: SGLang's ``out_cache_loc`` computed in torch with ``extend_rows``."""

    key = ASYNCPOOL_SLOTS
    label = "asyncpool: out_cache_loc in torch, extend_rows(rows_t[idx], 1)"

    def __init__(self, sc: Scenario) -> None:
        super().__init__(sc)
        self.lens = [sc.lens_tensor(j) for j in range(sc.steps)]
        self.rows_t = torch.zeros(0, dtype=torch.int64)
        self.last_loc = torch.zeros(0, dtype=torch.int64)

    def begin(self) -> list[torch.Tensor]:
        rows = self.admit()
        ps = self.sc.page_size
        self.rows_t = torch.tensor(rows, dtype=torch.int64)
        pages_of = self.pool.pages_of
        self.last_loc = torch.tensor(
            [
                int(pages_of(row)[-1]) * ps + (n - 1) % ps
                for row, n in zip(rows, self.sc.lens, strict=True)
            ],
            dtype=torch.int64,
        )
        return self.lens

    def step(self, arg: torch.Tensor) -> object:
        ps = self.sc.page_size
        need = arg % ps == 0
        idx = need.nonzero().squeeze(1)
        out = self.last_loc + 1
        if idx.numel():
            # A 1-D int64 tensor of rows, which extend_rows takes as free
            # does (and its annotation, Rows, says so: mypy checks it here).
            pages = self.extend_rows(self.rows_t[idx], 1)
            assert pages is not None
            out[idx] = pages.view(-1) * ps
        self.last_loc = out
        return out


class VllmBlocks(Side):
    """1: ``req_blocks[i].extend(block_pool.get_new_blocks(1))`` per crossing request."""

    key = VLLM

    def __init__(self, sc: Scenario) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.label = (
            f"vLLM {_version('vllm')} BlockPool, get_new_blocks(1) per crossing "
            "request (no KVCacheManager bookkeeping: favours vLLM)"
        )
        # Block 0 is vLLM's null block (never handed out), as our page 0.
        self.pool = BlockPool(
            num_gpu_blocks=sc.num_pages, enable_caching=False, hash_block_size=sc.page_size
        )
        self.start = sc.pages_at(0)
        self.req_blocks: list[list[Any]] = [self.pool.get_new_blocks(n) for n in self.start]
        self.crossing = [sc.crossing(j) for j in range(sc.steps)]

    def begin(self) -> list[list[int]]:
        return self.crossing

    def step(self, arg: list[int]) -> object:
        get_new_blocks, req_blocks = self.pool.get_new_blocks, self.req_blocks
        for i in arg:
            req_blocks[i].extend(get_new_blocks(1))
        return None

    def end(self) -> None:
        free_blocks = self.pool.free_blocks
        for blocks, n in zip(self.req_blocks, self.start, strict=True):
            free_blocks(blocks[n:])
            del blocks[n:]

    def available(self) -> int:
        return int(self.pool.get_num_free_blocks())


class VllmManager(Side):
    """1, the engine's path: ``allocate_slots(request, 1)`` for every request.

    ``caching = True`` (:class:`VllmManagerCaching`) is vLLM's default
    setting, as its engine builds it: prefix caching on, each ``Request``
    given the engine's block hasher (``sha256``, the default
    ``prefix_caching_hash_algo``), so ``allocate_slots`` caches each block
    as it fills and, once the free queue holds cached blocks, hands them out
    by evicting them. The hashes are computed as tokens are appended
    (``after``, untimed, as in vLLM where output processing does it). Each
    batch's requests get a fresh ``cache_salt``, so no batch hits an
    earlier one's cached prefix (this scenario has no shared prefixes)."""

    key = VLLM_MANAGER
    caching = False

    def __init__(self, sc: Scenario) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus

        setting = (
            "prefix caching on, vLLM's default, sha256 block hashes"
            if self.caching
            else "prefix caching off"
        )
        self.label = (
            f"vLLM {_version('vllm')} KVCacheManager.allocate_slots(request, 1) for "
            f"every request ({setting}; finds the crossing ones itself: favours asyncpool)"
        )
        self.hasher: Any = None
        if self.caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            hash_fn = get_hash_fn_by_name("sha256")
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(sc.page_size, hash_fn)
        self.batch = 0
        self.sc = sc
        spec = FullAttentionSpec(
            block_size=sc.page_size, num_kv_heads=1, head_size=1, dtype=torch.bfloat16
        )  # the worker's business; never read
        config = KVCacheConfig(
            num_blocks=sc.num_pages,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=sc.max_len,
            scheduler_block_size=sc.page_size,
            hash_block_size=sc.page_size,
            enable_caching=self.caching,
        )
        self.params = SamplingParams(max_tokens=sc.max_len)
        self.new_request, self.running = Request, RequestStatus.RUNNING
        self.requests: list[Any] = []

    def begin(self) -> list[None]:
        """Fresh requests, prefilled to the starting lengths, one token sampled."""
        allocate = self.manager.allocate_slots
        self.requests = []
        self.batch += 1
        for i, n in enumerate(self.sc.lens):
            if self.hasher is None:
                req = self.new_request(f"req-{i}", [0] * n, self.params, None)
            else:
                req = self.new_request(
                    f"req-{i}",
                    [0] * n,
                    self.params,
                    None,
                    cache_salt=f"{self.batch}-{i}",
                    block_hasher=self.hasher,
                )
            if allocate(req, n) is None:
                raise AssertionError(f"{self.label}: prefill of {n} tokens refused")
            req.num_computed_tokens = n
            req.status = self.running
            req.append_output_token_ids(0)
            self.requests.append(req)
        return [None] * self.sc.steps

    def step(self, arg: None) -> object:
        allocate = self.manager.allocate_slots
        for req in self.requests:
            if allocate(req, 1) is None:
                raise AssertionError(f"{self.label}: a decode step was refused")
        return None

    def after(self, j: int) -> None:
        for req in self.requests:
            req.num_computed_tokens += 1
            req.append_output_token_ids(0)

    def end(self) -> None:
        free = self.manager.free
        for req in self.requests:
            free(req)
        self.requests = []

    def available(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())


class VllmManagerCaching(VllmManager):
    """1, the engine's path in vLLM's default setting (prefix caching on)."""

    key = VLLM_MANAGER_CACHING
    caching = True


class SglangSlots(Side):
    """2: ``alloc_decode(seq_lens, seq_lens_cpu, last_loc)``."""

    key = SGLANG

    def __init__(self, sc: Scenario) -> None:
        self.label = (
            f"SGLang {_version('sglang')} PagedTokenToKVPoolAllocator.alloc_decode "
            "(CPU, torch path)"
        )
        self.sc = sc
        ps = sc.page_size
        self.alloc = _sglang_pool(sc.num_pages, ps)
        # SGLang picks its Triton kernel by platform (any CUDA host), not by
        # the allocator's device, and that kernel cannot read these CPU
        # tensors: the torch path, as on a host without CUDA.
        if getattr(self.alloc, "use_triton_kernels", False):
            self.alloc.use_triton_kernels = False
        start = sc.pages_at(0)
        slots = self.alloc.alloc(sum(start) * ps)  # the starting lengths' pages, held
        if slots is None:
            raise AssertionError(f"{self.label}: the starting pages do not fit")
        pages = (slots[::ps] // ps).tolist()
        last, at = [], 0
        for held, n in zip(start, sc.lens, strict=True):
            at += held
            last.append(pages[at - 1] * ps + (n - 1) % ps)
        self.last_loc0 = torch.tensor(last, dtype=torch.int64)
        self.last_loc = self.last_loc0
        # SGLang's seq_lens count the new token.
        self.seq_lens = [sc.lens_tensor(j + 1) for j in range(sc.steps)]
        self.new_at = [torch.tensor(sc.crossing(j), dtype=torch.int64) for j in range(sc.steps)]
        self.outs: list[torch.Tensor] = []

    def begin(self) -> list[torch.Tensor]:
        self.last_loc = self.last_loc0
        self.outs = []
        return self.seq_lens

    def step(self, arg: torch.Tensor) -> object:
        out = self.alloc.alloc_decode(arg, arg, self.last_loc)
        self.last_loc = out
        return out

    def after(self, j: int) -> None:
        if self.last_loc is None:
            raise AssertionError(f"{self.label}: alloc_decode refused step {j}")
        self.outs.append(self.last_loc)

    def end(self) -> None:
        ps = self.sc.page_size
        new = [out[at] // ps for out, at in zip(self.outs, self.new_at, strict=True)]
        if new:
            self.alloc.free_page_ids(torch.cat(new))
        self.outs = []

    def available(self) -> int:
        return int(self.alloc.available_size()) // self.sc.page_size


#: peer name -> (module that must be importable, loader, the bench it joins)
PEERS: dict[str, tuple[str, Callable[[Scenario], Side], str]] = {
    VLLM: ("vllm", VllmBlocks, BENCH_PAGES),
    VLLM_MANAGER: ("vllm", VllmManager, BENCH_PAGES),
    VLLM_MANAGER_CACHING: ("vllm", VllmManagerCaching, BENCH_PAGES),
    SGLANG: ("sglang", SglangSlots, BENCH_SLOTS),
}


def _load_peers(sc: Scenario) -> tuple[list[tuple[Side, str]], dict[str, str]]:
    """The installed peers with their bench, and for each missing one the line saying why."""
    found: list[tuple[Side, str]] = []
    skipped: dict[str, str] = {}
    for name, (module, loader, bench) in PEERS.items():
        peer, why = load_peer(module, functools.partial(loader, sc), "decode", name, INSTALL_HINT)
        if peer is not None:
            found.append((peer, bench))
        else:
            assert why is not None
            skipped[f"decode vs {name}"] = why
    return found, skipped


async def bench_decode(cfg: Config) -> tuple[list[Row], dict[str, str]]:
    """A decode step's allocator work: asyncpool against every installed peer.

    Returns the rows and, for each peer that is not installed, the line
    the report prints instead of its rows (keyed ``"decode vs <peer>"``).
    The asyncpool sides run (and are checked) even with no peer.
    """
    sc = Scenario.of(cfg)
    now = clock_of(cfg)
    sides: dict[str, Side] = {}
    benches: dict[str, str] = {}
    try:
        sides[ASYNCPOOL_PAGES] = AsyncpoolPages(sc)
        sides[ASYNCPOOL_SLOTS] = AsyncpoolSlots(sc)
        peers, skipped = _load_peers(sc)
        for peer, bench in peers:
            sides[peer.key] = peer
            benches[peer.key] = bench
        held = {key: side.available() for key, side in sides.items()}
        per_op = await interleave(
            {key: side.sampler(sc, now) for key, side in sides.items()},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call=dict.fromkeys(sides, sc.steps),
            start=1,
        )
        for key, side in sides.items():  # every batch gave back what it took
            if side.available() != held[key]:
                raise AssertionError(
                    f"{side.label}: {side.available()} pages free after the run, {held[key]} before"
                )
    finally:
        for side in sides.values():
            await side.close()
    lo, hi = cfg.decode_lens
    note = (
        f"{sc.requests} requests of {lo}-{hi - 1} tokens, "
        f"{sc.requests / sc.page_size:g} crossing a page a step on average; "
        f"{sc.num_pages:,}-page pool, {sc.page_size} slots a page"
    )
    subject = {BENCH_PAGES: sides[ASYNCPOOL_PAGES], BENCH_SLOTS: sides[ASYNCPOOL_SLOTS]}
    rows: list[Row] = []
    for key, bench in benches.items():
        mine, peer = subject[bench], sides[key]
        rows.append(
            compare(
                per_op,
                bench=bench,
                loop=LOOP,
                subject=mine.key,
                reference=key,
                subject_label=mine.label,
                reference_label=peer.label,
                unit="ns/step",
                speedup=True,
                target=None,
                note=note,
            )
        )
    return rows, skipped
