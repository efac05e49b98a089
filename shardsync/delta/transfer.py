"""Delta updates over the sync group: encode on the owners, move bytes, apply on engines.

Collective over every sync rank, like a full update.  Sizes are announced first (one
int64 per link), then the payload moves as uint8 chunks through the one executor.
p2p: every trainer rank diffs its own shards and sends each engine rank only its parts.
broadcast: a stage's TP ranks send their encoded parts to the stage source, which
broadcasts the concatenation; every engine rank keeps what falls in its pieces.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardsync.delta.encode import HEADER, decode, encode, encoding_of
from shardsync.delta.parts import Part, apply_values, p2p_parts, stage_parts, targets_for
from shardsync.dtypes import torch_dtype
from shardsync.piece import RankLayout
from shardsync.runtime.executor import BufferPool, execute
from shardsync.runtime.schedule import SyncRanks
from shardsync.runtime.stats import Stats
from shardsync.runtime.steps import Binding, Step
from shardsync.topology import Topology
from shardsync.transport import SyncGroup


class Snapshot:
    """The last synced values of a trainer rank's shards, in the wire dtype, on the host.

    Memory: one copy of the rank's local tensors at the wire dtype (pinned if asked).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype, *, pin: bool = False,
                 raw: Mapping[str, torch.dtype] | None = None) -> None:
        """``raw``: local tensors whose values move as their own bits (kept in their dtype)."""
        self.params, self.dtype = params, dtype
        raw = raw or {}
        self.values = {n: torch.empty(p.shape, dtype=raw.get(n, dtype), device="cpu", pin_memory=pin)
                       for n, p in params.items()}
        self.valid = False

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values.values())

    def refresh(self) -> None:
        for n, p in self.params.items():
            self.values[n].copy_(p.detach())
        self.valid = True

    def encode(self, parts: list[Part], stats: Stats) -> torch.Tensor:
        t0 = time.perf_counter()
        out = []
        for part in parts:
            new = self.params[part.local][part.region()].detach().to("cpu", part.dtype(self.dtype))
            blob = encode(new, self.values[part.local][part.region()])
            stats.encodings[encoding_of(blob)] += 1
            stats.elements += part.numel
            out.append(blob)
        stats.pack_s += time.perf_counter() - t0
        return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def _split(payload: torch.Tensor, parts: list[Part], dtype: torch.dtype) -> list[torch.Tensor]:
    """Cut a concatenation of encoded parts back into parts (each is self-delimiting)."""
    out, pos = [], 0
    for part in parts:
        item = part.dtype(dtype).itemsize
        enc, count = payload[pos:pos + HEADER].clone().view(torch.int64).tolist()
        per = {0: item, 1: 4 + item, 2: 2 + item}[enc]
        n = HEADER + count * per
        out.append(payload[pos:pos + n])
        pos += n
    if pos != payload.numel():
        raise ValueError(f"delta payload has {payload.numel() - pos} trailing bytes: layouts disagree")
    return out


def _apply(parts: list[Part], blobs: list[torch.Tensor], tensors: Mapping[str, torch.Tensor],
           targets: Mapping[Part, list], dtype: torch.dtype, stats: Stats) -> None:
    t0 = time.perf_counter()
    for part, blob in zip(parts, blobs, strict=True):
        pos, vals = decode(blob, part.numel, part.dtype(dtype))
        stats.changed += part.numel if pos is None else pos.numel()
        apply_values(part, pos, vals, tensors, targets[part])
    stats.unpack_s += time.perf_counter() - t0


def _chunks(n: int, budget: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + budget)) for a in range(0, n, budget)] or []


def _bind(key: str, n: int) -> tuple[Binding, ...]:
    return (Binding(key, (slice(0, n),), 0, (n,), (slice(0, n),)),)


def move_p2p(group: SyncGroup, me: int, links: list[tuple[int, int]], payloads: dict[int, torch.Tensor],
              budget: int, credits: int, pool: BufferPool, verify: bool = False) -> dict[int, torch.Tensor]:
    """One variable-size payload per link (src, dst): sizes first, then uint8 chunks in one
    global order (link, chunk).  Returns what this rank received, by source."""
    sizes, works = {}, []
    for s, d in links:
        if me == s:
            works.append(group.send(torch.tensor([payloads[d].numel()], dtype=torch.int64), d))
        elif me == d:
            sizes[s] = torch.zeros(1, dtype=torch.int64)
            works.append(group.recv(sizes[s], s))
    for w in works:
        w.wait()
    local: dict[str, torch.Tensor] = {}
    received: dict[int, torch.Tensor] = {}
    steps = []
    for i, (s, d) in enumerate(links):
        if me == s:
            data = payloads[d]
        elif me == d:
            data = received[s] = torch.empty(int(sizes[s].item()), dtype=torch.uint8)
        else:
            continue
        for j, (a, b) in enumerate(_chunks(data.numel(), budget)):
            key = f"l{i}.{j}"
            local[key] = data[a:b]
            if me == s:
                steps.append(Step(key, b - a, ("send", d), pack=_bind(key, b - a)))
            else:
                steps.append(Step(key, b - a, ("recv", s), drain=_bind(key, b - a)))
    execute(steps, local, group, pool=pool, credits=credits, verify=verify)
    return received


def gather_stage(group: SyncGroup | None, me: int, members: list[int], own: torch.Tensor | None,
                 budget: int, credits: int, pool: BufferPool, verify: bool = False) -> list[torch.Tensor] | None:
    """Every stage member's payload at the stage source (``members[0]``), in member order; None
    on other ranks.  Members pass their own payload; ranks outside the stage pass None."""
    source = members[0]
    links = [(r, source) for r in members if r != source]
    got = {}
    if links:
        if group is None:
            raise ValueError("a stage of several TP ranks gathers through the sync group")
        sending = {source: own} if me != source and own is not None else {}
        got = move_p2p(group, me, links, sending, budget, credits, pool, verify)
    if me != source:
        return None
    assert own is not None, "the stage source is a member: it passes its payload"
    return [own] + [got[r] for r in members if r != source]


def _move_bcast(group: SyncGroup, name: str, payload: torch.Tensor | None, budget: int,
                credits: int, pool: BufferPool, verify: bool = False) -> torch.Tensor | None:
    """Broadcast one variable-size payload from the group's root (``payload`` given there)."""
    if name not in group.groups:
        return None
    root = payload is not None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    group.broadcast(size, name, 0).wait()
    data = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    local, steps = {}, []
    for j, (a, b) in enumerate(_chunks(data.numel(), budget)):
        key = f"b{j}"
        local[key] = data[a:b]
        bind = _bind(key, b - a)
        steps.append(Step(key, b - a, ("bcast", name, 0, root), pack=bind if root else (),
                          drain=() if root else bind))
    execute(steps, local, group, pool=pool, credits=credits, verify=verify)
    return data


@dataclass
class DeltaRunner:
    """One sync rank's side of delta updates (trainer: ``snapshot`` set; engine: ``rank``)."""

    topo: Topology
    me: int
    budget: int
    credits: int = 2
    snapshot: Snapshot | None = None
    rank: RankLayout | None = None
    verify: bool = False  # payload chunks checked against their digest

    def __post_init__(self) -> None:
        self.ranks = SyncRanks(self.topo)
        self.dtype = torch_dtype(self.topo.wire_dtype)
        self.pool = BufferPool(torch.uint8)
        # Metadata an update needs, derived once per connection (never per update).
        self._memo: dict[tuple, list[Part]] = {}
        self._targets: dict[Part, list] = {}
        self._links: list[tuple[int, int]] | None = None

    def _parts(self, key: tuple) -> list[Part]:
        """p2p parts of a link ("p2p", src, engine rank) or a stage's parts ("stage", s)."""
        if key not in self._memo:
            if key[0] == "p2p":
                self._memo[key] = p2p_parts(self.topo.p2p_plan, key[1], key[2])
            else:
                self._memo[key] = stage_parts(self.topo.gather_plan, self.topo.stage_ranks(key[1]))
        return self._memo[key]

    def _targets_of(self, parts: list[Part]) -> dict[Part, list]:
        assert self.rank is not None
        for p in parts:
            if p not in self._targets:
                self._targets[p] = targets_for(p, self.rank)
        return self._targets

    def run(self, transport: str, tensors: Mapping[str, torch.Tensor], group: SyncGroup) -> Stats:
        stats = Stats()
        t0 = time.perf_counter()
        if transport == "p2p":
            self._p2p(tensors, group, stats)
        elif transport == "broadcast":
            for stage in range(self.topo.trainer.pp):
                self._stage(stage, tensors, group, stats)
                group.barrier()
        else:
            raise ValueError(f"delta transport {transport!r} runs through files, not the group")
        stats.transfer_s = time.perf_counter() - t0 - stats.pack_s - stats.unpack_s
        return stats

    def _p2p(self, tensors: Mapping[str, torch.Tensor], group: SyncGroup, stats: Stats) -> None:
        if self._links is None:
            self._links = sorted({(s, self.ranks.engine(d)) for s, d in self.topo.p2p_plan.link_bytes})
        links = self._links
        engine = self.ranks.trainer_world
        payloads = {}
        if self.snapshot is not None:
            for s, d in links:
                if s == self.me:
                    payloads[d] = self.snapshot.encode(self._parts(("p2p", s, d - engine)), stats)
                    stats.bytes_sent += payloads[d].numel()
        got = move_p2p(group, self.me, links, payloads, self.budget, self.credits, self.pool, self.verify)
        if self.rank is not None:
            for s, payload in sorted(got.items()):
                parts = self._parts(("p2p", s, self.me - engine))
                stats.bytes_received += payload.numel()
                _apply(parts, _split(payload, parts, self.dtype), tensors, self._targets_of(parts),
                       self.dtype, stats)

    def _stage(self, stage: int, tensors: Mapping[str, torch.Tensor], group: SyncGroup,
               stats: Stats) -> None:
        members = self.topo.stage_ranks(stage)
        source = members[0]
        parts = self._parts(("stage", stage))
        own = None
        if self.snapshot is not None and self.me in members:
            own = self.snapshot.encode([p for p in parts if p.owner == self.me], stats)
            if self.me != source:
                stats.bytes_sent += own.numel()
        gathered = gather_stage(group, self.me, members, own, self.budget, self.credits, self.pool, self.verify)
        # the source broadcasts the concatenation, in member order
        total = None
        if gathered is not None:
            total = torch.cat(gathered)
            stats.bytes_sent += total.numel()
        payload = _move_bcast(group, f"stage{stage}", total, self.budget, self.credits, self.pool, self.verify)
        if self.rank is not None and payload is not None:
            stats.bytes_received += payload.numel()
            _apply(parts, _split(payload, parts, self.dtype), tensors, self._targets_of(parts),
                   self.dtype, stats)
