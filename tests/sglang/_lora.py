"""SGLang's own LoRA manager on CPU, around a model ``_models.build`` made (its torch-native
LoRA backend).  One stand-in: SGLang's LoRA code pins host memory unconditionally, and the
torch SGLang pins (a CUDA build) cannot pin without a driver; ``no_pinning`` drops the pinning
while SGLang's code runs (pinning changes where bytes live, never their values)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "ones_like", "empty_like")


@contextlib.contextmanager
def no_pinning() -> Iterator[None]:
    saved = {n: getattr(torch, n) for n in _FACTORIES}
    saved_pin = torch.Tensor.pin_memory

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(torch, n, unpinned(fn))
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)
        torch.Tensor.pin_memory = saved_pin  # type: ignore[method-assign]


def manager(model: torch.nn.Module, hf_config, *, rank: int, targets: list[str], dtype: torch.dtype):
    """SGLang's ``LoRAManager`` of ``model`` (two slots: the base and one adapter)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora_manager import LoRAManager

    with no_pinning():
        return LoRAManager(model, hf_config, max_loras_per_batch=2, load_config=LoadConfig(), dtype=dtype,
                           server_args=None, lora_backend="torch_native", max_lora_rank=rank, target_modules=targets)


def fetch(mgr, ref) -> None:
    """What SGLang's scheduler does before a batch uses the adapter: copy it into a pool slot."""
    with no_pinning():
        mgr.fetch_new_loras({ref.lora_id})


def load_ref(mgr, ref) -> None:
    """What a scheduler does for SGLang's ``/load_lora_adapter`` (its registry made ``ref``, one
    id for every rank): load from ``ref.lora_path``, fetch into a slot; raises with SGLang's message."""
    out = mgr.load_lora_adapter(ref)
    if not out.success:
        raise RuntimeError(out.error_message)
    fetch(mgr, ref)


def load_tensors(mgr, tensors: dict[str, torch.Tensor], config: dict):
    """SGLang's ``load_lora_adapter_from_tensors`` of PEFT-named tensors, fetched into a slot."""
    from sglang.srt.lora.lora_registry import LoRARef

    ref = LoRARef(lora_name="expected", lora_path="tensors://expected", pinned=False)
    out = mgr.load_lora_adapter_from_tensors(ref, tensors, config)
    if not out.success:
        raise RuntimeError(out.error_message)
    fetch(mgr, ref)
    return ref


def slot_buffers(mgr, ref) -> dict[str, torch.Tensor]:
    """Every pool buffer's slice for ``ref``'s slot: ``A.<module>.<layer>`` and ``B.<module>.<layer>``."""
    pool = mgr.memory_pool
    slot = pool.uid_to_buffer_id[ref.lora_id]
    out = {}
    for kind, buffers in (("A", pool.A_buffer), ("B", pool.B_buffer)):
        for module, layers in buffers.items():
            for layer, t in enumerate(layers):
                out[f"{kind}.{module}.{layer}"] = t[slot].clone()
    return out
