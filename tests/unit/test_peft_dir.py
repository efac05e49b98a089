"""``receiver.peft_dir``: the adapter directory an engine reloads from is PEFT's own format
(PEFT loads it back bit for bit), holds one version or the other, and says what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from shardsync.lora import Lora, adapter_tensors
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from shardsync.receiver import peft_dir
from shardsync.receiver.destination import Slice

SPEC = PRESETS["tiny-qwen3"]
LORA = Lora(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    source = random_source(SPEC, seed, shapes=adapter_tensors(SPEC, LORA))
    return {n: source(n) for n in adapter_tensors(SPEC, LORA)}


def test_peft_loads_the_directory_bit_for_bit(tmp_path) -> None:
    import transformers
    from peft import PeftModel

    from shardsync.lora import from_peft

    adapter = _adapter(1)
    peft_dir.write_dir(tmp_path, LORA, adapter)
    assert peft_dir.read_config(tmp_path) == LORA
    config = transformers.AutoConfig.for_model(**SPEC.to_hf_config())
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path))
    loaded = {from_peft(n): p for n, p in model.named_parameters() if "lora_" in n}
    assert loaded.keys() == adapter.keys()
    assert all(torch.equal(loaded[n], adapter[n]) for n in adapter)
    assert model.peft_config["default"].lora_alpha == LORA.alpha and model.peft_config["default"].r == LORA.rank


def test_the_writer_replaces_the_weights_whole_from_slices(tmp_path) -> None:
    peft_dir.write_dir(tmp_path, LORA, _adapter(1))
    new = _adapter(2)
    name = next(iter(new))
    rows = new[name].shape[0] // 2
    slices = [Slice(n, (0, 0), tuple(t.shape), t) for n, t in new.items() if n != name]
    slices += [Slice(name, (0, 0), tuple(new[name].shape), new[name][:rows]),  # one tensor in two row blocks
               Slice(name, (rows, 0), tuple(new[name].shape), new[name][rows:])]
    peft_dir.writer(tmp_path, write=False)(iter(slices))
    assert all(torch.equal(t, _adapter(1)[n]) for n, t in peft_dir.read_weights(tmp_path).items())
    peft_dir.writer(tmp_path)(iter(slices))
    got = peft_dir.read_weights(tmp_path)
    assert got.keys() == new.keys() and all(torch.equal(got[n], new[n]) for n in new)
    assert sorted(p.name for p in tmp_path.iterdir()) == [peft_dir.CONFIG, peft_dir.WEIGHTS]  # no temporary left


def test_a_failed_write_leaves_the_previous_version(tmp_path) -> None:
    peft_dir.write_dir(tmp_path, LORA, _adapter(1))
    shared = torch.zeros(4)
    with pytest.raises(RuntimeError, match="share memory"):  # safetensors refuses it mid-write
        peft_dir.write_weights(tmp_path, {"a.lora_A.weight": shared, "b.lora_A.weight": shared})
    got = peft_dir.read_weights(tmp_path)
    assert all(torch.equal(t, _adapter(1)[n]) for n, t in got.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == [peft_dir.CONFIG, peft_dir.WEIGHTS]


@pytest.mark.parametrize("change, words", [
    ({"target_modules": "q_proj|v_proj"}, "regex"),
    ({"use_rslora": True}, "plain LoRA"),
    ({"rank_pattern": {"q_proj": 8}}, "patterns"),
])
def test_adapter_configs_it_cannot_sync_are_refused_by_name(tmp_path, change, words) -> None:
    peft_dir.write_dir(tmp_path, LORA, _adapter(1))
    cfg = json.loads((tmp_path / peft_dir.CONFIG).read_text()) | change
    (tmp_path / peft_dir.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        peft_dir.read_config(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        peft_dir.read_config(tmp_path / "elsewhere")


def test_an_engines_adapter_directory_comes_from_its_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("SHARDSYNC_TEST_LORA_DIR", raising=False)
    with pytest.raises(ValueError, match="SHARDSYNC_TEST_LORA_DIR is not set.*one --lora-paths entry"):
        peft_dir.served_dir("SHARDSYNC_TEST_LORA_DIR", "SGLang", "--lora-paths")
    monkeypatch.setenv("SHARDSYNC_TEST_LORA_DIR", str(tmp_path))
    assert peft_dir.served_dir("SHARDSYNC_TEST_LORA_DIR", "SGLang", "--lora-paths") == str(tmp_path)
