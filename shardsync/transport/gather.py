"""One kernel launch for every (destination, source) copy of a mapped update: the copies'
contiguous segments cut into equal tiles, listed once at compile as word offsets from two
base storages; each Triton program copies one tile.  Per-copy launches (``transport.copies.Copies``)
leave the device idle between small copies and tail each large one; a tile table does not.

``Segments.of`` (pure torch, CPU-testable) builds the table; ``Gather`` runs it (CUDA and
Triton only: ``available()`` says whether this process can).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TILE_BYTES = 16 << 10  # one program's share: large enough to amortize its start, small enough to balance


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _contiguous_tail(d: torch.Tensor, s: torch.Tensor) -> int:
    """How many trailing dims are one contiguous block in both views."""
    k, expect = 0, 1
    for dim in range(d.dim() - 1, -1, -1):
        if d.stride(dim) != expect or s.stride(dim) != expect:
            break
        expect *= d.shape[dim]
        k += 1
    return k


def _offsets(t: torch.Tensor, lead: int) -> torch.Tensor:
    """Element offsets (from ``t``'s first element) of every index of its first ``lead`` dims."""
    off = torch.zeros((), dtype=torch.int64)
    for dim in range(lead):
        off = off.unsqueeze(-1) + torch.arange(t.shape[dim], dtype=torch.int64) * t.stride(dim)
    return off.reshape(-1)


@dataclass
class Segments:
    """Contiguous byte segments (``src``, ``dst`` addresses, ``nbytes``) of a set of copies."""

    src: torch.Tensor  # int64 absolute byte addresses
    dst: torch.Tensor
    nbytes: torch.Tensor

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Segments:
        srcs, dsts, lens = [], [], []
        for d, s in pairs:
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(f"a gathered copy needs one shape and dtype on both sides, got "
                                 f"{tuple(d.shape)} {d.dtype} <- {tuple(s.shape)} {s.dtype}")
            if d.numel() == 0:
                continue
            lead = d.dim() - _contiguous_tail(d, s)
            size = d.element_size()
            for dim in range(lead, d.dim()):
                size *= d.shape[dim]
            srcs.append(s.data_ptr() + _offsets(s, lead) * s.element_size())
            dsts.append(d.data_ptr() + _offsets(d, lead) * d.element_size())
            lens.append(torch.full((srcs[-1].numel(),), size, dtype=torch.int64))
        if not srcs:
            empty = torch.zeros(0, dtype=torch.int64)
            return cls(empty, empty, empty)
        return cls(torch.cat(srcs), torch.cat(dsts), torch.cat(lens))

    def word(self) -> int:
        """The widest word (16, 8, 4, 2 or 1 bytes) every address and length is a multiple of."""
        every = torch.cat([self.src, self.dst, self.nbytes])
        for w in (16, 8, 4, 2):
            if bool((every % w == 0).all()):
                return w
        return 1

    def tiles(self, tile_bytes: int = TILE_BYTES) -> Segments:
        """The same bytes as segments of at most ``tile_bytes``."""
        count = (self.nbytes + tile_bytes - 1) // tile_bytes
        seg = torch.repeat_interleave(torch.arange(self.nbytes.numel()), count)
        first = torch.cumsum(count, 0) - count
        start = (torch.arange(seg.numel()) - first[seg]) * tile_bytes
        return Segments(self.src[seg] + start, self.dst[seg] + start,
                        torch.minimum(self.nbytes[seg] - start, torch.tensor(tile_bytes)))


_WORDS = {16: torch.int64, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_kernel = None


def _compile():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather(src_base, dst_base, src_off, dst_off, lens, count, TILE: tl.constexpr, BLOCK: tl.constexpr,
                   PAIRS: tl.constexpr, STREAMING: tl.constexpr, PERSISTENT: tl.constexpr):
            pid = tl.program_id(0)
            step = tl.num_programs(0) if PERSISTENT else count  # one tile per program unless persistent
            for t in tl.range(pid, count, step):
                s = tl.load(src_off + t)
                d = tl.load(dst_off + t)
                n = tl.load(lens + t)
                if PAIRS:  # every offset is a multiple of two words: 16-byte accesses
                    s = tl.multiple_of(s, 2)
                    d = tl.multiple_of(d, 2)
                for i in tl.range(0, TILE, BLOCK):
                    idx = i + tl.arange(0, BLOCK)
                    m = idx < n
                    if STREAMING:  # each byte is touched once: keep it out of the caches' way
                        v = tl.load(src_base + s + idx, mask=m, eviction_policy="evict_first")
                        tl.store(dst_base + d + idx, v, mask=m, cache_modifier=".cs")
                    else:
                        tl.store(dst_base + d + idx, tl.load(src_base + s + idx, mask=m), mask=m)

        _kernel = gather
    return _kernel


@dataclass(frozen=True)
class Tuning:
    """How the kernel walks the table (``benchmarks/gather_kernel.py`` sweeps these)."""

    tile_bytes: int = TILE_BYTES
    block_bytes: int = 16384  # bytes one loop step of a program moves (the default: one step, the whole tile)
    num_warps: int = 16
    streaming: bool = True  # evict-first loads, streaming stores
    per_sm: int = 0  # persistent: this many programs per SM loop over the tiles (0: one per tile)
    graph: bool = True  # from the second run on, replay the launch as a CUDA graph (~10 us, not ~90)


def configured() -> Tuning:
    """The kernel's tuning: ``Tuning()`` unless ``SHARDSYNC_GATHER`` holds JSON of its fields
    (for a device the defaults were not measured on; ``benchmarks/gather_kernel.py`` finds them)."""
    raw = os.environ.get("SHARDSYNC_GATHER")
    if not raw:
        return Tuning()
    try:
        return Tuning(**json.loads(raw))
    except (ValueError, TypeError) as e:
        raise ValueError(f"SHARDSYNC_GATHER must be JSON of {sorted(Tuning.__dataclass_fields__)}, "
                         f"got {raw[:80]!r}: {e}") from None


class Gather:
    """Every copy of ``pairs`` (device memory on both sides) in one launch on the current stream.

    Defaults (``Tuning``) from sweeps on the H200 (``benchmarks/gather_kernel.py --fine
    --repeat 3``): 16 KiB tiles copied in one step, 16 warps, streaming cache hints: Qwen3-4B
    1.021x one flat D2D copy, Qwen3-14B 1.025x, against 1.027x and 1.030x for the previous
    defaults (32 KiB tiles in 8 KiB steps) in the same runs; per-copy launches over four streams
    1.11x and 1.06x, the same copies as one CUDA graph of memcpys 1.09x and 1.08x.  Persistent
    programs were slower in every tuning tried.  From its second run on the launch is a CUDA
    graph replay (~10 us of CPU where the Triton launch takes ~25 us hot, ~90 us in an engine
    between updates)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], tuning: Tuning | None = None) -> None:
        tuning = tuning or configured()
        seg = Segments.of(pairs)
        self.tuning = tuning
        self.nbytes = int(seg.nbytes.sum())
        self.word = seg.word()
        dtype = _WORDS[self.word]
        unit = torch.empty((), dtype=dtype).element_size()
        tiles = seg.tiles(tuning.tile_bytes)
        self.count = tiles.nbytes.numel()
        self.device = device = pairs[0][0].device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._runs = 0
        # word offsets from two base storages (any address works: flat 64-bit device addresses)
        self._bases = [torch.empty(0, dtype=dtype, device=device).set_(t.untyped_storage(), 0, (1,), (1,))
                       for t in (pairs[0][1], pairs[0][0])]
        src0, dst0 = (b.data_ptr() for b in self._bases)
        self._tables = [((tiles.src - src0) // unit).to(device), ((tiles.dst - dst0) // unit).to(device),
                        (tiles.nbytes // unit).to(device)]
        programs = self.count
        if tuning.per_sm:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            programs = min(self.count, sms * tuning.per_sm)
        self.programs = max(1, programs)
        self._grid = (self.programs,)
        self._meta = dict(TILE=tuning.tile_bytes // unit,
                          BLOCK=max(1, min(tuning.tile_bytes, tuning.block_bytes) // unit),
                          PAIRS=self.word == 16, STREAMING=tuning.streaming, PERSISTENT=bool(tuning.per_sm),
                          num_warps=tuning.num_warps)

    def run(self) -> None:
        """Every copy, on the current stream of the copies' device (whatever this thread's
        current device is)."""
        if self.count == 0:
            return
        with torch.cuda.device(self.device):
            if self._graph is not None:
                self._graph.replay()
                return
            self._launch()
            self._runs += 1
            if self.tuning.graph and self._runs == 1:
                try:
                    self._graph = self._capture()
                except RuntimeError as e:  # a torch or Triton that cannot capture it: keep launching
                    log.info("gather: launches stay plain (capturing one as a CUDA graph failed: %s)", e)

    def _launch(self) -> None:
        _compile()[self._grid](*self._bases, *self._tables, self.count, **self._meta)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The launch as a graph (fixed tables and addresses: valid for this mapping's life);
        captured after a real launch compiled the kernel, copying nothing."""
        return capture(self._launch, self.device)


def capture(fn, device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn``'s launches as a CUDA graph, captured on a side stream of ``device`` that follows
    the current stream (which then follows it); errors of other threads do not break it."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph
