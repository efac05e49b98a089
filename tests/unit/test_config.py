"""Config records refuse values outside their tables, naming the field and the choices."""

from __future__ import annotations

import pytest

from shardsync.config import COMPLETIONS, IPC_KINDS, SIGNALS, ColocatedConfig


@pytest.mark.parametrize("field,choices", [("ipc", IPC_KINDS), ("complete", COMPLETIONS), ("signals", SIGNALS)])
def test_colocated_config_refuses_a_value_outside_its_table(field: str, choices: tuple[str, ...]) -> None:
    for ok in choices:
        assert getattr(ColocatedConfig(**{field: ok}), field) == ok
    with pytest.raises(ValueError, match=rf"{field} must be one of .*got 'bogus'"):
        ColocatedConfig(**{field: "bogus"})


def test_push_needs_the_mailbox() -> None:
    with pytest.raises(ValueError, match="keep signals='mailbox'"):
        ColocatedConfig(ipc="push", signals="group")
