"""Serving while syncing, end to end: clients generate continuously against a real engine
server (TP 2 workers) while trainer ranks push 20 updates.  Every response's version spans
must agree with when each version was committed, and every token's logprob must be what the
trainer's own model gives at that token's version (re-scored)."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from shardsync.config import SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.sync import WeightSync
from tests.dist._engine import shard_bytes, start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world

MODEL, UPDATES, CLIENTS = "tiny-qwen3", 20, 3


def _seed(version: int) -> int:
    return 500 + version


def _trainer(rank: int, world: int, port: int, url: str, updates: int, out) -> None:
    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=2, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=_seed(0))
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(mode="p2p", transport=TransportConfig(bucket_mb=0.05, timeout_s=60)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"ok": [], "begun": {}, "done": {}, "engines": []}
    for version in range(1, updates + 1):
        fresh = load_rank(lay, rank, random_source(spec, seed=_seed(version)))
        for k, v in params.items():
            v.copy_(fresh[k])
        res["begun"][version] = time.monotonic()
        rec = sync.update(version)
        res["done"][version] = time.monotonic()
        res["ok"].append(rec.ok)
        res["engines"].append(rec.engines_json())
        time.sleep(0.15)  # serving time between updates (in place, nothing is served during one)
    res["verify"] = sync.verify()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _client(url: str, stop: threading.Event, seed: int, got: list, errors: list) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            prompt = [rng.randrange(1, PRESETS[MODEL].vocab_size) for _ in range(rng.randint(2, 6))]
            body = {"prompts": [prompt], "max_new_tokens": rng.randint(4, 10), "temperature": 1.0,
                    "seed": rng.randrange(2**31)}
            sent = time.monotonic()
            r = http.post(url + "/generate", json=body)
            if r.status_code != 200:
                errors.append((r.status_code, r.text[:300]))
                continue
            got.append({"sent": sent, "received": time.monotonic(), "prompt": prompt, **r.json()})


def _rescore(responses: list[dict]) -> float:
    """Worst |engine logprob - trainer logprob| over every token, each token scored by the
    trainer model holding the version its span names."""
    from shardsync.models.trainer import TrainerModel

    spec, worst, models = PRESETS[MODEL], 0.0, {}
    for resp in responses:
        out = resp["outputs"][0]
        for span in out["spans"]:
            v = span["version"]
            if v not in models:
                models[v] = TrainerModel(spec, MegatronParallel(), source=random_source(spec, seed=_seed(v)))
            seq = resp["prompt"] + out["tokens"][: span["last"] + 1]
            logp = torch.log_softmax(models[v].logits(torch.tensor([seq]))[0], dim=-1)
            n = len(resp["prompt"])
            for i in range(span["first"], span["last"] + 1):
                worst = max(worst, abs(float(logp[n + i - 1, out["tokens"][i]]) - out["logprobs"][i]))
    return worst


STAGING = {"shard": lambda: -1, "0": lambda: 0, "window": lambda: shard_bytes(MODEL, 2) // 2}


@pytest.mark.parametrize("staging,crossing,updates", [("shard", "finish", UPDATES), ("window", "span", UPDATES // 2)],
                         ids=["staged-finish", "window-span"])
def test_clients_generate_through_20_updates(staging: str, crossing: str, updates: int) -> None:
    """The default (staged, finish) through 20 updates; half the shard staged (the rest
    received in place once the engine paused) with ``span`` through 10.  In place with
    ``span`` is the same scheduler path without the stage (tests/unit/test_dispatch.py)."""
    proc, url = start_engine(MODEL, 2, seed=_seed(0), staging_bytes=STAGING[staging](), crossing=crossing)
    stop, got, errors = threading.Event(), [], []
    clients = [threading.Thread(target=_client, args=(url, stop, i, got, errors), daemon=True)
               for i in range(CLIENTS)]
    try:
        httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1}, timeout=30)
        for c in clients:
            c.start()
        results = run_world(_trainer, 2, args=(2, free_port(), url, updates), timeout=300)
        stop.set()
        for c in clients:
            c.join(60)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        stop.set()
        stop_engine(proc)
    r0 = results[0]
    assert all(r0["ok"]) and len(r0["ok"]) == updates and r0["verify"] == [] and results[1]["verify"] == []
    assert errors == [], f"clients got errors: {errors[:3]}"
    assert len(got) >= updates, f"only {len(got)} responses during {updates} updates"
    begun = {int(k): v for k, v in r0["begun"].items()}
    done = {int(k): v for k, v in r0["done"].items()}
    done[0], begun[0] = 0.0, 0.0
    versions = set()
    for resp in got:
        spans = resp["outputs"][0]["spans"]
        tokens = resp["outputs"][0]["tokens"]
        assert spans[0]["first"] == 0 and spans[-1]["last"] == len(tokens) - 1
        assert all(a["last"] + 1 == b["first"] and a["version"] < b["version"] for a, b in zip(spans, spans[1:]))
        assert resp["weight_version"] == spans[-1]["version"]
        for s in spans:
            v = s["version"]
            versions.add(v)
            assert begun[v] <= resp["received"], f"version {v} served before its update began"
            if v + 1 in done:
                assert resp["sent"] <= done[v + 1], f"version {v} served after version {v + 1} was committed"
        if crossing == "finish":
            assert len(spans) == 1, f"a response mixes versions under the default policy: {spans}"
    assert len(versions) >= updates // 2, f"responses saw only versions {sorted(versions)}"
    assert _rescore(got) < 1e-4
    engine = [e[0] for e in r0["engines"]]
    assert all(e["staging"] == ("in-place" if staging == "0" else "swap") for e in engine)
    assert all(e["pause_s"] > 0 for e in engine)
    if staging != "0":
        assert all(e["stage_s"] > 0 and e["staging_bytes"] > 0 for e in engine)
        window = [e["staging_bytes"] < e["shard_bytes"] for e in engine]
        assert all(window) if staging == "window" else not any(window)
    if staging != "shard":        # 10 updates under 3 busy clients: some request was running at some update
        spanning = [r for r in got if len(r["outputs"][0]["spans"]) > 1]
        assert spanning and sum(e["crossed"] for e in engine) >= len(spanning)
    # the engine's Prometheus text, read by prometheus_client's parser: every update counted
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    count = {s.name: s.value for f in ("shardsync_update_seconds", "shardsync_update_pause_seconds")
             for s in families[f].samples if s.name.endswith("_count") and s.labels == {"path": "p2p"}}
    assert count == {"shardsync_update_seconds_count": updates, "shardsync_update_pause_seconds_count": updates}
    pause = [s for s in families["shardsync_update_phase_seconds"].samples
             if s.name.endswith("_sum") and s.labels == {"phase": "pause"}]
    assert pause and pause[0].value == pytest.approx(sum(e["pause_s"] for e in engine), rel=1e-6)
    spanning_total = [s.value for s in families["shardsync_generate_spanning"].samples if s.name.endswith("_total")]
    assert spanning_total == [sum(len(r["outputs"][0]["spans"]) > 1 for r in got)]
