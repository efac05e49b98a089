"""The engine server as users run it: a subprocess answering HTTP, refusing bad input."""

from __future__ import annotations

import httpx
import pytest

from tests.dist._engine import owner, start_engine, stop_engine


@pytest.fixture(scope="module")
def engine():
    proc, url = start_engine("tiny-llama", 2)
    yield url
    stop_engine(proc)


def test_generate_and_logprobs(engine: str) -> None:
    req = {"prompts": [[5, 6, 7], [9]], "max_new_tokens": 6, "temperature": 1.0, "seed": 3}
    a = httpx.post(engine + "/generate", json=req, timeout=60).json()
    b = httpx.post(engine + "/generate", json=req, timeout=60).json()
    assert a == b, "same seed must give the same tokens"
    c = httpx.post(engine + "/generate", json=req | {"seed": 4}, timeout=60).json()
    assert c["outputs"] != a["outputs"]
    out = a["outputs"][0]
    assert len(out["tokens"]) == 6 and len(out["logprobs"]) == 6
    assert a["weight_version"] == 0
    seq = [5, 6, 7] + out["tokens"]
    lp = httpx.post(engine + "/logprobs", json={"sequences": [seq]}, timeout=60).json()
    assert lp["weight_version"] == 0
    scored = lp["logprobs"][0][-6:]
    assert max(abs(x - y) for x, y in zip(scored, out["logprobs"], strict=True)) < 1e-4


@pytest.mark.parametrize("body,status", [
    (b"not json", 422),
    (b'{"prompts": []}', 422),
    (b'{"prompts": [[1, 2]], "max_new_tokens": -1}', 422),
    (b'{"prompts": [[1, 2]], "top_p": 0}', 422),
    (b'{"prompts": [[1, 999999]]}', 400),
    (b'{"prompts": [[1]], "unknown_field": 1}', 422),
])
def test_malformed_requests_get_4xx_and_server_keeps_serving(engine: str, body: bytes, status: int) -> None:
    r = httpx.post(engine + "/generate", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    ok = httpx.post(engine + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_oversized_request_rejected(engine: str) -> None:
    r = httpx.post(engine + "/generate", content=b"x" * (9 * 2**20),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_update_endpoints_refuse_bad_requests_and_keep_weights(engine: str) -> None:
    before = httpx.get(engine + "/weights/checksum", timeout=60).json()
    # not connected
    r = httpx.post(engine + "/weights/begin", json={"version": 1, "mode": "p2p", "fingerprint": "x"}, headers=owner(), timeout=30)
    assert r.status_code == 409 and "not connected" in r.text
    # malformed
    r = httpx.post(engine + "/weights/begin", json={"version": "one", "mode": "p2p"}, headers=owner(), timeout=30)
    assert r.status_code == 422
    r = httpx.post(engine + "/weights/connect", json={"spec": {}}, headers=owner(), timeout=30)
    assert r.status_code == 422
    # a plan exchange with the wrong fingerprint is refused with the reason
    info = httpx.get(engine + "/weights/info", timeout=30).json()
    connect = {
        "spec": info["spec"], "trainer": {"tp": 2}, "engines": [2], "engine_index": 0,
        "fingerprints": {"p2p": "0000000000000000"}, "bucket_bytes": 65536,
        "rendezvous": {"host": "127.0.0.1", "port": 1, "world_size": 4, "name": "x"},
    }
    r = httpx.post(engine + "/weights/connect", json=connect, headers=owner(), timeout=30)
    assert r.status_code == 409 and "fingerprint mismatch" in r.text
    # a different model is refused
    other = dict(info["spec"], hidden_size=info["spec"]["hidden_size"] * 2)
    r = httpx.post(engine + "/weights/connect", json=connect | {"spec": other}, headers=owner(), timeout=30)
    assert r.status_code == 409
    r = httpx.post(engine + "/weights/finish", json={"version": 7}, headers=owner(), timeout=30)
    assert r.status_code == 404
    after = httpx.get(engine + "/weights/checksum", timeout=60).json()
    assert after == before
    assert httpx.get(engine + "/health", timeout=30).json()["status"] == "ok"


def test_metrics(engine: str) -> None:
    text = httpx.get(engine + "/metrics", timeout=30).text
    assert "shardsync_weight_version 0" in text
    assert "shardsync_generate_requests_total" in text
