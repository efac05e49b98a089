"""The mailbox's records: numbered, checked, never taken torn, waited for under a deadline."""

from __future__ import annotations

import threading

import pytest
import torch

from shardsync.transport.mailbox import ACK, HEADER, SLOT, Mailbox


def test_a_record_is_taken_once_its_number_passes_the_last_one() -> None:
    box = Mailbox(Mailbox.words())
    box.post(HEADER, 1, [3, 1])
    assert box.take(HEADER, 2, after=0, timeout_s=1, what="header") == (1, [3, 1])
    with pytest.raises(TimeoutError, match="no header within 0.05s"):
        box.take(HEADER, 2, after=1, timeout_s=0.05, what="header")
    box.post(HEADER, 3, [4, 0])  # a number skipped (an update the other end never took) is fine
    assert box.take(HEADER, 2, after=1, timeout_s=1, what="header") == (3, [4, 0])
    with pytest.raises(TimeoutError):  # the slots are independent
        box.take(ACK, 2, after=0, timeout_s=0.01, what="ack")


def test_a_record_whose_check_does_not_match_is_not_taken() -> None:
    """What a reader sees between the payload and the number landing (or a torn write)."""
    words = Mailbox.words()
    box = Mailbox(words)
    box.post(ACK, 1, [5, 2, 7])
    words[SLOT + 2] = 6  # the payload changed under an old check
    with pytest.raises(TimeoutError):
        box.take(ACK, 3, after=0, timeout_s=0.02, what="ack")
    words[SLOT + 2] = 5
    assert box.take(ACK, 3, after=0, timeout_s=1, what="ack") == (1, [5, 2, 7])


def test_a_waiting_reader_takes_a_record_posted_later_from_another_thread() -> None:
    box = Mailbox(Mailbox.words())
    threading.Timer(0.05, box.post, args=(HEADER, 1, [9, 1])).start()
    assert box.take(HEADER, 2, after=0, timeout_s=10, what="header") == (1, [9, 1])  # past the spin: sleeping


@pytest.mark.parametrize("bad", [torch.zeros(2 * SLOT, dtype=torch.int32), torch.zeros(SLOT, dtype=torch.int64),
                                 torch.zeros(4 * SLOT, dtype=torch.int64)[::2]])
def test_only_its_own_shape_of_words_makes_a_mailbox(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous int64 words"):
        Mailbox(bad)
    with pytest.raises(ValueError, match="up to 14 words"):
        Mailbox(Mailbox.words()).post(HEADER, 1, list(range(15)))
