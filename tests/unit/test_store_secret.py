"""Every process has a secret: the given one, else this user's own, made once in a directory
only the user can enter and refused when anybody else could read it."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest

from shardsync.store.secret import (
    ENV_RUNTIME_DIR,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    USER_SECRET,
    load_secret,
    runtime_dir,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in (ENV_TOKEN, ENV_TOKEN_FILE):
        monkeypatch.delenv(name, raising=False)
    d = tmp_path / "runtime"
    monkeypatch.setenv(ENV_RUNTIME_DIR, str(d))
    return d


def test_nothing_given_makes_this_users_secret_once(home: Path) -> None:
    first = load_secret()
    assert not first.given and str(home / USER_SECRET) in first.origin and len(first.value) == 64
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / USER_SECRET).st_mode) == 0o600
    assert load_secret() == first  # read, not made again
    assert [p.name for p in home.iterdir()] == [USER_SECRET]  # no temporary file left


def test_a_given_secret_comes_first(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "tok"
    f.write_text("from-a-file-0123456789\n")
    assert load_secret("an-argument-0123456789").value == "an-argument-0123456789"
    assert load_secret(token_file=str(f)).value == "from-a-file-0123456789"
    monkeypatch.setenv(ENV_TOKEN_FILE, str(f))
    assert load_secret().given and load_secret().value == "from-a-file-0123456789"
    monkeypatch.setenv(ENV_TOKEN, "from-the-environment-0123")
    assert load_secret().value == "from-the-environment-0123"
    assert not home.exists()  # a given secret never makes the user's own
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_secret("short")


def test_a_directory_others_can_enter_is_refused(home: Path) -> None:
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    with pytest.raises(PermissionError, match=r"open to other users \(mode 755\).*chmod 700"):
        load_secret()
    assert not (home / USER_SECRET).exists()


def test_a_secret_file_others_can_read_is_refused(home: Path) -> None:
    load_secret()
    os.chmod(home / USER_SECRET, 0o644)
    with pytest.raises(PermissionError, match=r"mode 644.*chmod 600"):
        load_secret()


def test_a_linked_secret_file_is_refused(home: Path, tmp_path: Path) -> None:
    home.mkdir(mode=0o700)
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("an-attackers-secret-0123456789\n")
    os.chmod(elsewhere, 0o600)
    (home / USER_SECRET).symlink_to(elsewhere)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        load_secret()


def _read(q) -> None:
    q.put(load_secret().value)


def test_racing_processes_read_one_secret(home: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_read, args=(q,)) for _ in range(4)]
    for p in procs:
        p.start()
    got = {q.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(got) == 1 and got == {(home / USER_SECRET).read_text().strip()}


def test_runtime_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_RUNTIME_DIR, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path / "shardsync"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir() == Path.home() / ".local" / "share" / "shardsync" / "runtime"
