"""Write a HuggingFace checkpoint directory of a model spec: ``config.json``, one
``model.safetensors`` and a word-level tokenizer (token ``i`` is the word ``t{i}``).

Real engines (vLLM, SGLang) start from a checkpoint directory; with no hub access here,
tests and the demo write a tiny one from the same logical tensors the trainer starts from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import TensorSource
from shardsync.spec import ModelSpec


def token_text(ids: list[int]) -> str:
    """The text the checkpoint's tokenizer encodes to ``ids``."""
    return " ".join(f"t{i}" for i in ids)


def _tokenizer_json(vocab: int) -> dict:
    # The tokenizers library's serialized form of a WordLevel model split on whitespace.
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
    }


def write_checkpoint(spec: ModelSpec, source: TensorSource, path: str | Path, *,
                     dtype: torch.dtype = torch.float32) -> Path:
    """``path`` holding ``spec``'s logical tensors from ``source`` in ``dtype``."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = spec.to_hf_config()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.update(bos_token_id=1, eos_token_id=2)
    (root / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = {name: source(name).to(dtype).contiguous() for name in logical_tensors(spec)}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "tokenizer.json").write_text(json.dumps(_tokenizer_json(spec.vocab_size)))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1",
        "eos_token": "t2", "model_max_length": spec.max_position_embeddings}))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return root
