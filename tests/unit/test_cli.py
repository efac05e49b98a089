"""The command line speaks to a user: every flag says what it does, and what the user can fix
ends in one line and exit status 2, not a traceback."""

from __future__ import annotations

import argparse
import json

import pytest

from shardsync import cli


def _parsers(parser: argparse.ArgumentParser, name: str = "shardsync"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_flag_says_what_it_does() -> None:
    silent = [f"{name} {'/'.join(a.option_strings)}"
              for name, p in _parsers(cli.build_parser()) for a in p._actions
              if a.option_strings and not a.help]
    assert not silent, f"flags without help: {silent}"


def test_top_level_help_speaks_to_a_user() -> None:
    text = cli.build_parser().format_help()
    assert "one subcommand per job" not in text
    for command in ("plan", "demo", "bench", "engine"):
        assert command in text


def test_defaults_are_shown(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "(default: tiny-qwen3)" in out and "(default: 5)" in out


def test_short_token_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    token = tmp_path / "token"
    token.write_text("short")
    assert cli.main(["engine", "serve", "--model", "tiny-qwen3", "--token-file", str(token), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "16 characters" in err[0], err


def test_missing_engine_extra_names_the_extra(monkeypatch, capsys) -> None:
    """``pip install shardsync`` without extras: the demo says what to install before it spawns."""
    monkeypatch.setattr(cli, "ENGINE_EXTRA", ("fastapi", "shardsync_no_such_module"))
    assert cli.main(["demo", "--steps", "1", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'shardsync[engine]'" in err[0], err


def test_plan_for_an_fp8_engine_carries_half_the_bytes(capsys) -> None:
    args = ["plan", "--model", "tiny-qwen3-fp8", "--trainer-tp", "2", "--engine-tp", "2", "--json"]
    assert cli.main(args) == 0
    wide = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "--engine-quantization", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    for a, b in zip(wide["paths"], fp8["paths"], strict=True):
        assert b["total_bytes"] <= 0.55 * a["total_bytes"], (a["path"], b["total_bytes"] / a["total_bytes"])
    assert fp8["p2p_ok"]


def test_plan_of_an_adapter_moves_the_adapter_alone(capsys) -> None:
    args = ["plan", "--model", "Qwen3-8B", "--trainer-tp", "4", "--engine-tp", "2"]
    assert cli.main([*args, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "--lora-rank", "16", "--lora-targets", "q_proj,v_proj", "--json"]) == 0
    adapter = json.loads(capsys.readouterr().out)
    for a, b in zip(whole["paths"], adapter["paths"], strict=True):
        assert b["total_bytes"] < 0.01 * a["total_bytes"], (a["path"], b["total_bytes"] / a["total_bytes"])
    assert cli.main([*args, "--lora-rank", "16"]) == 0
    assert "LoRA adapter of rank 16 alone" in capsys.readouterr().out
