"""Config records refuse values outside their tables, naming the field and the choices."""

from __future__ import annotations

import pytest

from shardsync.config import ColocatedConfig, ControlConfig, DeltaConfig, SyncConfig
from shardsync.vocab import Channel, Completion, Crossing, Ipc, Request, Signals


@pytest.mark.parametrize("field,words", [("ipc", Ipc), ("complete", Completion), ("signals", Signals)])
def test_colocated_config_refuses_a_value_outside_its_table(field: str, words) -> None:
    for word in words:
        if (field, word) == ("signals", Signals.GROUP):
            continue  # the default ipc (map) takes either; push needs the mailbox (below)
        got = getattr(ColocatedConfig(**{field: word.value}), field)
        assert got is word, "the text becomes the word once, at construction"
    with pytest.raises(ValueError, match=rf"{field} must be one of .*got 'bogus'"):
        ColocatedConfig(**{field: "bogus"})


def test_configs_hold_words_not_text() -> None:
    cfg = SyncConfig(mode="p2p", control=ControlConfig(channel="http", crossing="span"),
                     delta=DeltaConfig(transport="broadcast"))
    assert cfg.mode is Request.P2P and cfg.control.channel is Channel.HTTP
    assert cfg.control.crossing is Crossing.SPAN
    assert cfg.delta is not None and cfg.delta.transport == "broadcast"
    assert cfg.mode == "p2p", "a word still compares equal to its text"
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'p2p', 'broadcast'\), got 'fast'"):
        SyncConfig(mode="fast")
    with pytest.raises(ValueError, match="crossing"):
        ControlConfig(crossing="later")


def test_push_needs_the_mailbox() -> None:
    with pytest.raises(ValueError, match="keep signals='mailbox'"):
        ColocatedConfig(ipc="push", signals="group")
