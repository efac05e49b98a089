"""One trainer<->engine pair's per-update signals: the trainer's header, the engine's ack and
(push) the engine's next staging set, numbered records in the link's shared-memory mailbox
(``transport.mailbox``) or int64 words over the sync group where the engine could not map it.
Each end holds its own half (``TrainerLink``, ``EngineLink``), so every signal is checked
against the update it belongs to and neither side waits for a word the other never sends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from shardsync.runtime.stats import Stats, StepTiming
from shardsync.transport import events
from shardsync.transport.colocated.share import Share
from shardsync.transport.handles import TensorHandle, open_tensor
from shardsync.transport.mailbox import ACK as ACK_SLOT
from shardsync.transport.mailbox import HEADER, STAGED, Mailbox
from shardsync.vocab import Refused

log = logging.getLogger(__name__)

READY, FAILED, QUEUED, REFUSED = 1, 0, 2, 3  # ack status; QUEUED: complete at the ack's event
ACK_WORDS = 2 + events.WORDS  # generation, status, then the engine's event (QUEUED)
ABORT = -1  # generation sent when the sender cannot offer its tensors this update
MAILBOX, GROUP = "mailbox", "group"  # how a link signals (its engine end chose at connect)

Ack = Callable[[], list[int]]  # waits for one engine rank's ack of a signalled update


class TrainerLink:
    """The trainer's end of the link to engine sync rank ``peer``: it posts numbered headers
    and takes the acks (and, push, the engine's staging set)."""

    def __init__(self, share: Share, peer: int, mailbox: bool) -> None:
        """``mailbox``: offer the engine a shared-memory mailbox for the signals (in the first export)."""
        self.share, self.peer, self.mailbox = share, peer, mailbox
        self.box: Mailbox | None = None  # made at the first export, when offered
        self.how: str | None = None  # MAILBOX | GROUP as the engine chose: read at the first update

    def offer(self) -> torch.Tensor | None:
        """The words the first export carries as the link's mailbox (None: not offered)."""
        return Mailbox.words() if self.mailbox else None

    def hold(self, words: torch.Tensor) -> None:
        """The offered words, exported (which moved them into shared memory)."""
        self.box = Mailbox(words)

    def signal(self, number: int, words: list[int]) -> Ack:
        """Post update ``number``'s header ``words``; the callable returns the engine's ack."""
        box = self.box if self._how() == MAILBOX else None
        peer, group = self.peer, self.share.group
        if box is not None:
            box.post(HEADER, number, words)
            timeout = group.rdv.timeout_s

            def box_ack() -> list[int]:
                got, ack = box.take(ACK_SLOT, ACK_WORDS, after=number - 1, timeout_s=timeout,
                                    what=f"ack of update {number} from sync rank {peer}")
                if got != number:
                    raise RuntimeError(f"sync rank {peer} acked update {got}, expected {number}")
                return ack

            return box_ack
        send = group.send(torch.tensor(words, dtype=torch.int64), peer)
        buf = torch.zeros(ACK_WORDS, dtype=torch.int64)
        recv = group.recv(buf, peer)

        def group_ack() -> list[int]:
            send.wait()
            recv.wait()
            return buf.tolist()

        return group_ack

    def _how(self) -> str:
        how = self.how
        if how is None:
            key = self.share.keys.signals(self.share.rank, self.peer)
            self.share.wait(key)
            raw = self.share.get(key)
            how = raw.decode() if isinstance(raw, bytes) else raw
            if how not in (MAILBOX, GROUP) or (how == MAILBOX and self.box is None):
                raise ValueError(f"store key {key} holds {how[:40]!r}, not {MAILBOX!r} or {GROUP!r}")
            self.how = how
        return how

    def staged(self, number: int, sets: int) -> int:
        """Push: the set the engine stages update ``number`` into, once it is done with every earlier one."""
        box = self.box
        if box is None:
            raise RuntimeError(f"the link to sync rank {self.peer} has no mailbox for its staging sets")
        got, (index,) = box.take(STAGED, 1, after=number - 1, timeout_s=self.share.group.rdv.timeout_s,
                                 what=f"sync rank {self.peer}'s staging set for update {number}")
        if got != number or not 0 <= index < sets:
            raise RuntimeError(f"sync rank {self.peer} posted staging set {index} for update {got}, expected a set "
                               f"below {sets} for update {number}")
        return index


def signal(links: Sequence[TrainerLink], number: int, header: list[int],
           extra: Mapping[int, list[int]] | None = None) -> list[Ack]:
    """Post ``header`` (and ``extra[peer]`` after it) as update ``number`` on every link, in order."""
    return [link.signal(number, header + list((extra or {}).get(link.peer, ()))) for link in links]


def judged(stats: Stats, acks: list[list[int]], error: Exception | None, share: Share) -> Stats:
    """A sender's update: its stats, or the error it ends with (its own first, then the engines')."""
    if error is not None:
        raise error
    stats.steps = [StepTiming("map", f"{share.rank}->{p}", share.peer_bytes[p], transfer_s=stats.transfer_s)
                   for p in share.peers]
    refused = [p for a, p in zip(acks, share.peers, strict=True) if a[1] == REFUSED]
    if refused:
        raise Refused(f"sync rank(s) {refused} refused this update before reading (the engine's answer says why)")
    failed = [p for a, p in zip(acks, share.peers, strict=True) if a[1] not in (READY, QUEUED)]
    if failed:
        raise RuntimeError(f"sync rank(s) {failed} failed reading this rank's mapped tensors")
    stats.bytes_sent = share.nbytes
    return stats


class EngineLink:
    """The engine's end of the link from trainer sync rank ``peer``: it takes headers and
    answers them (and, push, posts the staging set the next update writes)."""

    def __init__(self, share: Share, peer: int) -> None:
        self.share, self.peer = share, peer
        self.box: Mailbox | None = None
        self.opened = False  # the first handle set chose how the link signals
        self.taken = 0  # number of the last header taken (mailbox)

    def open(self, handle: TensorHandle | None) -> None:
        """Map the link's mailbox (if offered) and tell the trainer which way this end signals."""
        self.opened, self.taken = True, 0
        how = GROUP
        if handle is not None:
            try:
                self.box = Mailbox(open_tensor(handle))
                how = MAILBOX
            except Exception as e:  # another /dev/shm or shm manager than the trainer's
                log.info("sync rank %d: cannot map sync rank %d's mailbox (%s): signalling over the sync group",
                         self.share.rank, self.peer, e)
        key = self.share.keys.signals(self.peer, self.share.rank)
        self.share.put(key, how)

    def header(self, size: int) -> list[int]:
        """The trainer's next header: ``size`` words ([generation, stream] and, push, the set)."""
        box = self.box
        if box is None:
            header = torch.zeros(size, dtype=torch.int64)
            self.share.group.recv(header, self.peer).wait()
            return header.tolist()
        got, words = box.take(HEADER, size, after=self.taken, timeout_s=self.share.group.rdv.timeout_s,
                              what=f"update signal from trainer sync rank {self.peer}")
        self.taken = got
        return words

    def answer(self, ack: list[int]) -> None:
        box = self.box
        if box is None:
            self.share.group.send(torch.tensor(ack, dtype=torch.int64), self.peer).wait()
        else:
            box.post(ACK_SLOT, self.taken, ack)

    def refuse(self, size: int) -> None:
        """Answer an update the engine refused: take the header, ack ``REFUSED``, touch nothing."""
        self.answer([self.header(size)[0], REFUSED] + [0] * events.WORDS)

    def post_staged(self, index: int) -> None:
        """Push: tell the trainer which set its next update writes (numbered: the update after the last taken)."""
        box = self.box
        if box is None:
            raise RuntimeError(f"the link from sync rank {self.peer} has no mailbox for its staging sets")
        box.post(STAGED, self.taken + 1, [index])

    def close(self) -> None:
        """Forget the mailbox and the count: a later handle set opens the link again."""
        self.box, self.opened, self.taken = None, False, 0


def proceeds(peer: int, generation: int, error: Exception | None) -> bool:
    """Engine: whether ``peer``'s part of a receive goes on (no earlier error); an abort the
    trainer signalled raises."""
    if generation == ABORT:
        raise RuntimeError(f"trainer sync rank {peer} aborted the update before sending")
    return error is None
