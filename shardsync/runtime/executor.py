"""The one executor: runs a rank's steps with bounded buffers in flight.

Callers on every rank of a transfer call ``execute`` with the steps compiled for that
rank from the same plan; steps are in one global order on every rank, which with
oldest-first completion makes any credit window deadlock-free.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from shardsync.dtypes import torch_dtype
from shardsync.runtime.stats import Stats, StepTiming
from shardsync.runtime.steps import Binding, Step

log = logging.getLogger(__name__)


class Work(Protocol):
    """An operation in flight; ``wait`` returns once it completed (bounded by the transport's timeout)."""

    def wait(self) -> object: ...


class Transport(Protocol):
    """Moves flat buffers; every call returns a handle whose ``wait`` honours a timeout."""

    def send(self, buf: torch.Tensor, peer: int) -> Work: ...
    def recv(self, buf: torch.Tensor, peer: int) -> Work: ...
    def broadcast(self, buf: torch.Tensor, group: str, root: int) -> Work: ...
    def synchronize(self) -> None: ...

    def lend(self, kind: str, peer: int, numel: int) -> torch.Tensor | None:
        """A buffer the transport owns for this message (CUDA IPC slots), or None."""
        ...

    def give_back(self, kind: str, peer: int, buf: torch.Tensor) -> None:
        """A lent buffer is done with (unpacked or packed)."""
        ...


class Pooled:
    """``Transport`` defaults for transports whose messages use the executor's pooled buffers."""

    def lend(self, kind: str, peer: int, numel: int) -> torch.Tensor | None:
        return None

    def give_back(self, kind: str, peer: int, buf: torch.Tensor) -> None:
        return None


class BufferPool:
    """Flat buffers reused across steps and updates (one per credit, grown on demand)."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self._free: list[torch.Tensor] = []
        self.allocated_bytes = 0

    def get(self, numel: int, size: int = 0) -> torch.Tensor:
        """A buffer of at least ``numel`` elements (return it with ``put``).

        New buffers get ``max(numel, size)`` elements: sized to a schedule's largest step, a
        pool never holds more buffers than the steps in flight.
        """
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        buf = torch.empty(max(numel, size), dtype=self.dtype, device=self.device)
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def put(self, buf: torch.Tensor) -> None:
        self._free.append(buf)


def _span(buf: torch.Tensor, offset: int, shape: tuple[int, ...], raw: str | None) -> torch.Tensor:
    """``shape`` elements of the buffer from ``offset``: in the buffer's dtype, or the bits of
    ``raw`` (as many buffer elements as its bytes take)."""
    if raw is None:
        return buf[offset:offset + _numel(shape)].view(shape)
    dtype = torch_dtype(raw)
    width = dtype.itemsize // buf.element_size()
    return buf[offset:offset + _numel(shape) * width].view(dtype).view(shape)


def _buf_view(buf: torch.Tensor, b: Binding) -> torch.Tensor:
    return _span(buf, b.offset, b.box, b.raw)[b.sub]


def _resolve(b: Binding, local: Mapping[str, torch.Tensor], main: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (local if b.space == "local" else main)[b.key][b.region]


def _main_views(step: Step, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: _span(buf, off, shape, raw) for key, off, shape, raw in step.main_views}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Many small copies in one call (one multi-tensor launch on CUDA, fewer Python trips)."""
    if len(dsts) > 1 and dsts[0].is_cuda:
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)


def pack(step: Step, buf: torch.Tensor, local: Mapping[str, torch.Tensor],
         main: Mapping[str, torch.Tensor] | None = None) -> None:
    """Copy the step's local regions into its message buffer."""
    _copy_all([_buf_view(buf, b) for b in step.pack],
              [_resolve(b, local, main if main is not None else _main_views(step, buf)) for b in step.pack])


def drain(step: Step, buf: torch.Tensor, local: Mapping[str, torch.Tensor]) -> None:
    """Copy a received message buffer into the step's local regions."""
    main = _main_views(step, buf)
    _copy_all([_resolve(b, local, main) for b in step.drain], [_buf_view(buf, b) for b in step.drain])


def _zero_copy(bindings: tuple[Binding, ...], local: Mapping[str, torch.Tensor], dtype: torch.dtype,
               numel: int) -> torch.Tensor | None:
    """The local tensor itself when one binding covers all of it (no pack/unpack copy)."""
    if len(bindings) != 1 or bindings[0].space != "local":
        return None
    b = bindings[0]
    t = local[b.key]
    if b.raw is not None or t.dtype != dtype or not t.is_contiguous() or t.numel() != numel:
        return None
    if any(r.start != 0 or r.stop != s for r, s in zip(b.region, t.shape, strict=True)):
        return None
    return t.view(-1)


class CorruptBucket(RuntimeError):
    """A message arrived with other bytes than were sent (its checksum differs)."""


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def digest(buf: torch.Tensor) -> torch.Tensor:
    """``int64[1]``: the wrapping sum of a flat buffer's bytes read as the widest words that
    divide it.  Any corrupted word changes it; it is one read of the buffer (no copy)."""
    raw = buf.reshape(-1).view(torch.uint8)
    width, dtype = next((w, d) for w, d in _WORDS if raw.numel() % w == 0)
    return raw.view(dtype).sum(dtype=torch.int64).reshape(1)


def _check(step: Step, buf: torch.Tensor, sent: torch.Tensor, peer: object) -> None:
    got = int(digest(buf).item())
    if got != int(sent.item()):
        raise CorruptBucket(f"bucket {step.label} ({step.link}) from sync rank {peer} arrived corrupted "
                            f"(checksum {got}, sent {int(sent.item())}); the update fails and the engine "
                            "stays stale until a full update")


@torch.no_grad()
def execute(steps: Sequence[Step], local: Mapping[str, torch.Tensor], transport: Transport, *,
            pool: BufferPool, credits: int = 2, detail: bool = False, verify: bool = False) -> Stats:
    """Run ``steps`` in order, at most ``credits`` buffers in flight; oldest completes first.

    ``verify``: every message is followed by its ``digest`` (one more small message on the same
    link) and receivers check it before unpacking; senders and receivers must agree on it."""
    stats = Stats()
    wall = time.time() - time.perf_counter()  # perf_counter -> wall clock (step times, with ``detail``)
    inflight: deque = deque()
    size = max((max([s.numel] + [f.numel for f in s.fill]) for s in steps), default=0)
    itemsize = torch.empty((), dtype=pool.dtype).element_size()

    def complete_oldest() -> None:
        step, buf, base, work, pooled, lent, timing, posted, check = inflight.popleft()
        t0 = time.perf_counter()
        if work is not None:
            work.wait()
        if check is not None:
            check[0].wait()
            if check[2]:  # this rank received: compare before a byte is unpacked
                _check(step, buf, check[1], step.comm[1])
        t1 = time.perf_counter()
        timing.transfer_s += t1 - posted
        stats.transfer_s += t1 - t0
        if (pooled or lent) and step.drain:  # a direct receive landed in place already
            drain(step, buf, local)
        t2 = time.perf_counter()
        timing.unpack_s += t2 - t1
        timing.landed, timing.done = wall + t1, wall + t2
        stats.unpack_s += t2 - t1
        if lent:
            transport.give_back(step.comm[0], step.comm[1], base)
        elif pooled:
            pool.put(base)

    for step in steps:
        while len(inflight) >= credits or (step.fence and inflight):
            complete_oldest()
        timing = StepTiming(step.label, step.link, step.numel * itemsize)
        t0 = time.perf_counter()
        kind = step.comm[0] if step.comm else "local"
        direct = lent = None
        if kind in ("send", "recv") and not step.fill:
            lent = transport.lend(kind, step.comm[1], step.numel)  # unpack from (or pack into) its memory
        if lent is None and kind == "send" and not step.fill:
            direct = _zero_copy(step.pack, local, pool.dtype, step.numel)
        elif lent is None and kind == "recv":
            direct = _zero_copy(step.drain, local, pool.dtype, step.numel)
        base = lent if lent is not None else direct if direct is not None else pool.get(step.numel, size)
        buf = base[:step.numel]
        if direct is None:
            main = _main_views(step, buf)
            pack(step, buf, local, main)
            for sub in step.fill:
                sbase = pool.get(sub.numel, size)
                sbuf = sbase[:sub.numel]
                transport.recv(sbuf, sub.peer).wait()
                if verify:
                    sent = torch.zeros(1, dtype=torch.int64, device=sbuf.device)
                    transport.recv(sent, sub.peer).wait()
                    _check(step, sbuf, sent, sub.peer)
                for b in sub.bindings:
                    _resolve(b, local, main).copy_(_buf_view(sbuf, b))
                stats.bytes_received += sub.numel * itemsize
                pool.put(sbase)
        t1 = time.perf_counter()
        timing.pack_s += t1 - t0
        timing.start, timing.posted = wall + t0, wall + t1
        stats.pack_s += t1 - t0
        work: Work | None = None
        check = None  # (work, digest tensor, whether this rank checks it)
        if kind == "send":
            work = transport.send(buf, step.comm[1])
            stats.bytes_sent += step.numel * itemsize
            if verify:
                d = digest(buf)
                check = (transport.send(d, step.comm[1]), d, False)
        elif kind == "recv":
            work = transport.recv(buf, step.comm[1])
            stats.bytes_received += step.numel * itemsize
            if verify:
                d = torch.zeros(1, dtype=torch.int64, device=buf.device)
                check = (transport.recv(d, step.comm[1]), d, True)
        elif kind == "bcast":
            work = transport.broadcast(buf, step.comm[1], step.comm[2])
            if step.comm[3]:
                stats.bytes_sent += step.numel * itemsize
            else:
                stats.bytes_received += step.numel * itemsize
            if verify:
                d = digest(buf) if step.comm[3] else torch.zeros(1, dtype=torch.int64, device=buf.device)
                check = (transport.broadcast(d, step.comm[1], step.comm[2]), d, not step.comm[3])
        inflight.append((step, buf, base, work, direct is None and lent is None, lent is not None,
                         timing, time.perf_counter(), check))
        if detail:
            stats.steps.append(timing)
            log.debug("step %s link=%s bytes=%d pack=%.4fs", step.label, step.link, timing.bytes,
                      timing.pack_s)
    while inflight:
        complete_oldest()
    transport.synchronize()
    stats.peak_buffer_bytes = pool.allocated_bytes
    return stats

