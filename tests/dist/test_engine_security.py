"""Nobody but the trainer changes an engine: a real engine server started with a token,
probed as an outside client would.  Unauthenticated or wrongly authenticated state-changing
calls are refused and change nothing; the trainer with the token syncs as usual; disk pulls
stay under the configured root; bounded inputs never answer 500."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.control.client import SyncError
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("deltas")
    token_file = root.parent / "token"
    token_file.write_text(TOKEN + "\n")
    proc, url = start_engine("tiny-qwen2", 1, token_file=str(token_file), delta_root=str(root))
    yield url, root
    stop_engine(proc)


def _state(url: str) -> tuple:
    version = httpx.get(url + "/weights/version", timeout=30).json()
    sums = httpx.get(url + "/weights/checksum", timeout=30).json()["checksums"]
    return version["weight_version"], version["connected"], json.dumps(sums, sort_keys=True)


CALLS = [
    ("/weights/connect", {"protocol": 2}), ("/weights/join", None),
    ("/weights/begin", {"version": 99, "mode": "p2p", "fingerprint": "x"}),
    ("/weights/finish", {"version": 99}), ("/weights/pull", {"root": "/tmp", "version": 99}),
    ("/weights/disconnect", None),
]


@pytest.mark.parametrize("path,body", CALLS)
def test_state_changing_calls_need_the_token_and_change_nothing(engine, path: str, body) -> None:
    url, _ = engine
    before = _state(url)
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"], r.text
    r = httpx.post(url + path, json=body, timeout=30, headers={"Authorization": "Bearer wrong-token-xxxxxxxxxx"})
    assert r.status_code == 403 and "wrong token" in r.json()["error"], r.text
    assert _state(url) == before


def test_the_trainer_with_the_token_syncs_and_one_without_is_refused(engine) -> None:
    url, _ = engine
    torch.set_num_threads(1)
    spec, par = PRESETS["tiny-qwen2"], MegatronParallel(tp=1)
    params = load_rank(Topology(spec, par).trainer_layout, 0, random_source(spec, seed=4))
    stranger = WeightSync(spec, par, 0, params, [url], SyncConfig(control=ControlConfig(token="not-the-engine-token")))
    with pytest.raises(SyncError, match="403"):
        stranger.connect()
    sync = WeightSync(spec, par, 0, params, [url], SyncConfig(control=ControlConfig(token=TOKEN),
                                                              transport=TransportConfig(timeout_s=30)))
    sync.connect()
    rec = sync.update(1)
    assert rec.ok and sync.verify() == []
    sync.close()


def test_an_engine_given_no_secret_is_still_authenticated(monkeypatch) -> None:
    """Nothing set: the engine takes this user's own secret, a caller without it changes
    nothing, and this user's trainer syncs with no flag (it reads the same file)."""
    for name in ("SHARDSYNC_TOKEN", "SHARDSYNC_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    proc, url = start_engine("tiny-qwen2", 1)
    try:
        before = _state(url)
        for path, body in CALLS:
            r = httpx.post(url + path, json=body, timeout=30)
            assert r.status_code == 401, (path, r.text)
            r = httpx.post(url + path, json=body, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 403, (path, r.text)
        assert _state(url) == before
        torch.set_num_threads(1)
        spec, par = PRESETS["tiny-qwen2"], MegatronParallel(tp=1)
        params = load_rank(Topology(spec, par).trainer_layout, 0, random_source(spec, seed=5))
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(transport=TransportConfig(timeout_s=30)))
        sync.connect()
        assert sync.update(1).ok and sync.verify() == []
        sync.close()
        assert "control calls need the secret from this user's secret file" in open(proc.log_path).read()
    finally:
        stop_engine(proc)


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_disk_pulls_stay_under_the_delta_root(engine, tmp_path) -> None:
    url, root = engine
    before = _state(url)
    outside = httpx.post(url + "/weights/pull", json={"root": str(tmp_path), "version": 50}, headers=_auth(),
                         timeout=30)
    assert outside.status_code == 409 and "outside this engine's delta root" in outside.text
    sneaky = httpx.post(url + "/weights/pull", json={"root": str(root / ".." / tmp_path.name), "version": 50},
                        headers=_auth(), timeout=30)
    assert sneaky.status_code == 409
    version = root / "v000050"
    version.mkdir()
    (version / "manifest.json").write_text(json.dumps({"version": 50, "base_version": before[0],
                                                       "stages": ["../../token"]}))
    crafted = httpx.post(url + "/weights/pull", json={"root": str(root), "version": 50}, headers=_auth(), timeout=30)
    assert crafted.status_code == 422 and "stages must be names like" in crafted.text
    old = httpx.post(url + "/weights/pull", json={"root": str(root), "version": 0}, headers=_auth(), timeout=30)
    assert old.status_code == 409 and "not newer" in old.text
    assert _state(url) == before


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4),
                           max_leaves=12)
FIELDS = {
    "/generate": ["prompts", "max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids"],
    "/logprobs": ["sequences"],
    "/weights/begin": ["version", "mode", "fingerprint", "base_version"],
    "/weights/connect": ["protocol", "spec", "trainer", "engines", "engine_index", "fingerprints",
                         "bucket_bytes", "rendezvous"],
    "/weights/pull": ["root", "version"],
}
special = st.sampled_from([float("nan"), float("inf"), 1e-300, -1e-300, 10**30, -1, 0, 2**63, [[1] * 5000],
                           [[0, 1, 2]], "p2p", "delta-p2p"])


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    keys = draw(st.lists(st.sampled_from(FIELDS[path]), unique=True, max_size=len(FIELDS[path])))
    body = {k: draw(special | json_values) for k in keys}
    return path, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_no_client_input_answers_500(engine, req) -> None:
    url, _ = engine
    path, body = req
    r = httpx.post(url + path, content=json.dumps(body, allow_nan=True), timeout=60,
                   headers={"content-type": "application/json", **_auth()})
    assert r.status_code < 500 or (r.status_code == 503 and "stale" not in r.text), (path, body, r.text)


def test_a_chunked_body_over_the_limit_is_refused_before_parsing(engine) -> None:
    url, _ = engine

    def chunks():
        for _ in range(20):
            yield b" " * (1 << 20)

    r = httpx.post(url + "/generate", content=chunks(), timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_engine_refuses_a_public_host_without_a_given_secret() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSYNC_TOKEN")}
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "engine", "serve", "--model", "tiny-qwen3",
                        "--host", "0.0.0.0", "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "this user's own secret" in r.stderr
