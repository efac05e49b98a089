"""Every test session gets its own runtime directory: the user's own shardsync secret
(``store/secret.py``) is made there, never in the real home, and every process the tests start
(engines, trainers, vLLM and SGLang hosts) inherits it."""

from __future__ import annotations

import os
import tempfile

import pytest

from shardsync.store.secret import ENV_RUNTIME_DIR


@pytest.fixture(scope="session", autouse=True)
def _own_runtime_dir():
    if os.environ.get(ENV_RUNTIME_DIR):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="shardsync-runtime-") as d:  # mode 0700
        os.environ[ENV_RUNTIME_DIR] = d
        try:
            yield
        finally:
            os.environ.pop(ENV_RUNTIME_DIR, None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls in process: extra intra-op threads only spin, badly so on a busy machine
    (a module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
