"""The modules a LoRA adapter can target, as a table: each target's HF module (PEFT's names),
how tensor parallelism cuts its base weight, and the Megatron adapter that holds it.

Megatron shards an adapter as it shards its base linear: a column-parallel layer keeps ``A``
whole and splits ``B`` by output rows; a row-parallel layer splits ``A`` by input columns and
keeps ``B`` whole.  Fused layers (QKV, gate/up) get one adapter per target (Megatron-Bridge's
canonical LoRA), so every adapter tensor is one PEFT tensor and the rows are plain cuts."""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.family.kinds import Split, Whole
from shardsync.family.table import Row


@dataclass(frozen=True)
class Target:
    """``module``: after ``model.layers.{L}.``; ``column``: TP splits the base weight's rows
    (else its columns); ``megatron``: the adapter module under Megatron's layer prefix;
    ``attention``: part of the attention block (else the dense MLP)."""

    module: str
    column: bool
    megatron: str
    attention: bool

    @property
    def a(self) -> str:
        return self.module + ".lora_A.weight"

    @property
    def b(self) -> str:
        return self.module + ".lora_B.weight"

    def rows(self, megatron: bool) -> tuple[Row, Row]:
        """The local tensors of ``A`` and ``B`` under Megatron's names (``linear_in`` /
        ``linear_out``) or the engine's (PEFT's)."""
        names = (self.megatron + ".linear_in.weight", self.megatron + ".linear_out.weight") if megatron \
            else (self.a, self.b)
        kinds = (Whole(self.a), Split(self.b, dim=0)) if self.column else (Split(self.a, dim=1), Whole(self.b))
        return Row(names[0], kinds[0]), Row(names[1], kinds[1])


_QKV, _FC1 = "self_attention.linear_qkv.adapter.", "mlp.linear_fc1.adapter."
TARGETS = {
    "q_proj": Target("self_attn.q_proj", True, _QKV + "adapter_q", True),
    "k_proj": Target("self_attn.k_proj", True, _QKV + "adapter_k", True),
    "v_proj": Target("self_attn.v_proj", True, _QKV + "adapter_v", True),
    "o_proj": Target("self_attn.o_proj", False, "self_attention.linear_proj.adapter", True),
    "gate_proj": Target("mlp.gate_proj", True, _FC1 + "adapter_gate", False),
    "up_proj": Target("mlp.up_proj", True, _FC1 + "adapter_up", False),
    "down_proj": Target("mlp.down_proj", False, "mlp.linear_fc2.adapter", False),
}
PEFT_PREFIX = "base_model.model."  # a PeftModel's parameters: the wrapped model's names under it


def from_peft(name: str, adapter: str = "default") -> str:
    """A PeftModel parameter's logical name: ``base_model.model.<module>.lora_A.default.weight``
    -> ``<module>.lora_A.weight`` (PEFT's checkpoint name)."""
    return name.removeprefix(PEFT_PREFIX).replace(f".{adapter}.", ".")

