"""A LoRA adapter as PEFT configures it: its rank, alpha and the modules it targets.

Trainer and engines must agree on all three (the engine computes ``alpha / rank`` and holds
one adapter pair per target), so the connect request carries them and an engine refuses a
different adapter by name."""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.lora.table import TARGETS

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Lora:
    """``targets``: PEFT's ``target_modules`` (module names, ``TARGETS``' keys), in table order."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_LINEAR

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError("a LoRA adapter targets at least one module (PEFT's target_modules)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not modules shardsync adapts; pick from {list(TARGETS)}")
        order = tuple(t for t in TARGETS if t in self.targets)
        if order != self.targets:  # one spelling per adapter: the fingerprints compare it
            object.__setattr__(self, "targets", order)

    @property
    def scale(self) -> float:
        """What ``B @ A`` is multiplied by (PEFT's ``lora_alpha / r``, no rsLoRA)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Lora:
        rank, alpha, targets = d["rank"], d["alpha"], d["targets"]
        if not isinstance(rank, int) or not isinstance(alpha, int | float) or not isinstance(targets, list):
            raise ValueError(f"a LoRA adapter is {{rank: int, alpha: number, targets: [str]}}, got {d}")
        return cls(rank, float(alpha), tuple(str(t) for t in targets))
