"""The secret a trainer and its engines share: the one the user gave, else this user's own.

No process runs without one.  A user who sets nothing still gets authenticated calls: the
first shardsync process of that user on a machine makes a random secret in a directory only
the user can enter (Jupyter's runtime-file habit), and every later one - engine, trainer, the
vLLM and SGLang hosts - reads it.  Another local user can read neither.  Runs across machines
set ``$SHARDSYNC_TOKEN`` (or a file) on every side.  Threat model: ``docs/security.md``.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV_TOKEN = "SHARDSYNC_TOKEN"
ENV_TOKEN_FILE = "SHARDSYNC_TOKEN_FILE"
ENV_RUNTIME_DIR = "SHARDSYNC_RUNTIME_DIR"
MIN_TOKEN_CHARS = 16
USER_SECRET = "secret"  # the file's name in the runtime directory


@dataclass(frozen=True)
class Secret:
    """A secret and where it came from (said in logs and errors; the value never is)."""

    value: str
    origin: str
    given: bool  # set by the user (argument, file, environment), not this user's own default


def runtime_dir() -> Path:
    """Where this user's secret lives: ``$SHARDSYNC_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/shardsync``, else ``~/.local/share/shardsync/runtime``."""
    if os.environ.get(ENV_RUNTIME_DIR):
        return Path(os.environ[ENV_RUNTIME_DIR])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "shardsync"
    return Path.home() / ".local" / "share" / "shardsync" / "runtime"


def load_secret(token: str | None = None, token_file: str | None = None) -> Secret:
    """``token``, else ``token_file``, else ``$SHARDSYNC_TOKEN``, else the file named by
    ``$SHARDSYNC_TOKEN_FILE``, else this user's own secret (made on first use)."""
    if token is not None:
        return _checked(Secret(token, "the given token", True))
    if token_file is not None:
        return _checked(Secret(Path(token_file).read_text().strip(), f"token file {token_file}", True))
    if os.environ.get(ENV_TOKEN):
        return _checked(Secret(os.environ[ENV_TOKEN], f"${ENV_TOKEN}", True))
    if os.environ.get(ENV_TOKEN_FILE):
        path = os.environ[ENV_TOKEN_FILE]
        return _checked(Secret(Path(path).read_text().strip(), f"${ENV_TOKEN_FILE} ({path})", True))
    return user_secret()


def _checked(s: Secret) -> Secret:
    if len(s.value) < MIN_TOKEN_CHARS:
        raise ValueError(f"the shardsync secret from {s.origin} must be at least {MIN_TOKEN_CHARS} characters "
                         "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return s


def user_secret() -> Secret:
    """This user's own secret, made once (atomically: racing processes all read the winner's)."""
    home = runtime_dir()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private(home, stat.S_ISDIR, "directory")
    path = home / USER_SECRET
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=home, prefix=".secret-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # whole file or nothing: a reader never sees half of it
                log.info("made this user's shardsync secret at %s (this user's engines and trainers on this "
                         "machine share it; across machines set $%s on every side)", path, ENV_TOKEN)
            except FileExistsError:
                pass  # another process made it first
        finally:
            os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        _private(path, stat.S_ISREG, "file", os.fstat(fd))
        value = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    return _checked(Secret(value, f"this user's secret file {path}", False))


def _private(path: Path, kind: Callable[[int], bool], what: str, st: os.stat_result | None = None) -> None:
    """Refuse a secret's directory or file that is not this user's own, or that others may read."""
    st = st or os.lstat(path)
    if not kind(st.st_mode):
        raise PermissionError(f"{path} is not a plain {what} (a link?): remove it, or set ${ENV_TOKEN}")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to user {st.st_uid}, not to this user ({os.getuid()}): "
                              f"set ${ENV_RUNTIME_DIR} to a directory of your own, or set ${ENV_TOKEN}")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"`chmod {'700' if what == 'directory' else '600'} {path}`, or set ${ENV_TOKEN}")
