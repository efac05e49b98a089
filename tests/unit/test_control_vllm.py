"""``control.vllm``'s connect-time facts: vLLM's HTTP facts say whether it serves LoRA
adapters, not which; the client reports the trainer's adapter for a LoRA vLLM (its workers
check that claim against their adapter directory) and refuses a whole-model sync into one."""

from __future__ import annotations

import pytest

from shardsync.control.adapters import vllm_served
from shardsync.control.client import SyncError
from shardsync.lora import Lora

TOKEN = "t" * 32


def test_a_lora_vllm_serves_the_trainers_adapter_claim_and_refuses_a_whole_model_sync() -> None:
    lora = Lora(8, 16.0, ("q_proj", "v_proj"))
    assert vllm_served("u", {"lora_config": {"max_lora_rank": 8}}, lora) == lora
    assert vllm_served("u", {"lora_config": None}, lora) is None  # then the connect refuses: no adapter
    with pytest.raises(SyncError, match="shardsync syncs its adapter alone"):  # a whole-model sync into it
        vllm_served("u", {"lora_config": {"max_lora_rank": 8}}, None)
    assert vllm_served("u", {}, None) is None
