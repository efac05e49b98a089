"""The demo through the Ray launcher on a local CPU cluster: trainer ranks and the engine
server as actors in placement groups, trainer TP2 -> engine TP2, bitwise verified."""

from __future__ import annotations

import json

import pytest
import ray
from ray.util.placement_group import placement_group_table

from shardsync.demo import DemoConfig
from shardsync.launch.ray import RayConfig, bundles, run_ray


@pytest.fixture(scope="module")
def local_ray(request):
    # 4 logical CPUs: 2 trainer bundles + one engine bundle of 2, on however many cores.
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=True)
    request.addfinalizer(ray.shutdown)


def test_bundles_gpu_and_cpu():
    cfg = DemoConfig(trainer_tp=2, trainer_pp=2, engine_tp=(4, 2))
    trainer, engines = bundles(cfg, gpus=True)
    assert trainer == [{"CPU": 1.0, "GPU": 1.0}] * 4
    assert engines == [{"CPU": 4.0, "GPU": 4.0}, {"CPU": 2.0, "GPU": 2.0}]
    trainer, engines = bundles(cfg, gpus=False)
    assert trainer == [{"CPU": 1.0}] * 4 and engines == [{"CPU": 4.0}, {"CPU": 2.0}]


@pytest.mark.demos  # ~20 s: CI runs the demos as their own step
def test_demo_on_ray_bitwise(local_ray, tmp_path, capsys):
    cfg = DemoConfig(model="tiny-qwen3", trainer_tp=2, engine_tp=(2,), steps=2, mode="both",
                     out=str(tmp_path), timeout_s=60)
    assert run_ray(cfg, RayConfig(ready_timeout_s=60)) == 0
    printed = capsys.readouterr().out
    assert "CPU bundles" in printed and "bitwise checksum after every sync: ok" in printed

    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps["launcher"] == "ray" and steps["gpu_bundles"] is False
    assert [r["step"] for r in steps["steps"]] == [1, 2]
    for row in steps["steps"]:
        assert set(row["updates"]) == {"p2p", "broadcast"}
        for mode, u in row["updates"].items():
            assert u["checksum_ok"] is True, (row["step"], mode, u["mismatch"])
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [(r["version"], r["mode"], r["ok"]) for r in records] == [
        (1, "p2p", True), (1, "broadcast", True), (2, "p2p", True), (2, "broadcast", True)]
    # nothing left reserved: both placement groups were removed
    assert {pg["state"] for pg in placement_group_table().values()} <= {"REMOVED"}


def test_too_small_cluster_is_refused_at_once(local_ray, tmp_path, capsys):
    cfg = DemoConfig(model="tiny-qwen3", trainer_tp=2, engine_tp=(8,), steps=1, out=str(tmp_path))
    assert run_ray(cfg, RayConfig(ready_timeout_s=5)) == 1
    assert "CPU needed 10, cluster has 4" in capsys.readouterr().err


def test_ipc_is_refused_under_ray(capsys):
    """Ray gives every actor its own CUDA_VISIBLE_DEVICES: handles would name the wrong GPU."""
    cfg = DemoConfig(model="tiny-qwen3", steps=1, ipc=True)
    assert run_ray(cfg) == 2
    assert "--no-ipc" in capsys.readouterr().err
