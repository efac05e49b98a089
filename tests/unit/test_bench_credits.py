"""Credit limits and buffer reuse, through the runtime executor and the tracing transport."""

from __future__ import annotations

import pytest
import torch

from shardsync.bench.metrics import max_overlap
from shardsync.bench.policy import plan_waves
from shardsync.bench.schedule import effective_credits, global_order, rank_program
from shardsync.bench.topology import partition
from shardsync.bench.transport import FreshPool, TracingTransport, make_pool
from shardsync.bench.workload import synthetic
from shardsync.runtime.executor import BufferPool, Pooled, execute


class _Done:
    def wait(self) -> None:
        pass


class _Loopback(Pooled):
    """Completes every transfer at once and remembers which buffers it saw."""

    def __init__(self) -> None:
        self.ptrs: list[int] = []

    def _op(self, buf: torch.Tensor) -> _Done:
        self.ptrs.append(buf.data_ptr())
        return _Done()

    def send(self, buf, peer):
        return self._op(buf)

    def recv(self, buf, peer):
        return self._op(buf)

    def broadcast(self, buf, group, root):
        return self._op(buf)

    def synchronize(self) -> None:
        pass


def test_bytes_cap_lowers_credits_and_refuses_a_cap_below_one_message() -> None:
    assert effective_credits(4, None, 1 << 20) == 4
    assert effective_credits(4, 2 << 20, 1 << 20) == 2
    assert effective_credits(1, 8 << 20, 1 << 20) == 1
    assert effective_credits(3, (1 << 20) + 5, 1 << 20) == 1
    with pytest.raises(ValueError, match="below the largest message"):
        effective_credits(2, 1000, 1 << 20)
    with pytest.raises(ValueError, match="credits must be"):
        effective_credits(0, None, 10)


def _sender_run(credits: int, pool: BufferPool, count: int = 6) -> tuple[TracingTransport, _Loopback]:
    lay = partition(5, group_size=2)
    program = rank_program(global_order(plan_waves("all_at_once", 2), synthetic(lay, "p2p", nbytes=1024, count=count)),
                           0, lay)
    inner = _Loopback()
    tracer = TracingTransport(inner, lay, 0)
    for item in program:
        if isinstance(item, tuple):
            execute(list(item), {}, tracer, pool=pool, credits=credits)
    return tracer, inner


@pytest.mark.parametrize("credits", [1, 2, 3])
def test_observed_inflight_never_exceeds_credits(credits: int) -> None:
    tracer, _ = _sender_run(credits, make_pool(True, torch.device("cpu")))
    rows = [(r.t_post, r.t_end, r.nbytes) for r in tracer.records]
    assert len(rows) == 2 * 2 * 6 and all(r.t_end is not None for r in tracer.records)
    assert max_overlap(rows) == credits * 1024  # the executor fills its window, and no more
    assert {r.group for r in tracer.records} == {0, 1}
    assert not any(r.synced for r in tracer.records), "no device sync on CPU"


def test_buffer_reuse_on_allocates_one_window_off_allocates_per_transfer() -> None:
    reuse = make_pool(True, torch.device("cpu"))
    _, seen_reuse = _sender_run(2, reuse)
    assert reuse.allocated_bytes == 2 * 1024
    assert len(set(seen_reuse.ptrs)) == 2
    fresh = make_pool(False, torch.device("cpu"))
    assert isinstance(fresh, FreshPool)
    _, seen_fresh = _sender_run(2, fresh)
    assert fresh.allocated_bytes == 24 * 1024
    assert fresh.dtype == torch.uint8  # a message of n bytes is n elements
