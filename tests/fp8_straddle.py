"""A Qwen3 whose FP8 blocks the trainer's shards cut: 6 query and 2 KV heads of 64, so a TP 2
trainer (or FSDP2's row halves) holds 192 query rows per rank, cutting q_proj's middle 128-row
block (and o_proj's middle column block); the 128 key and value rows are cut at 64.  Engines
serve it at TP 1 only (their TP 2 shards would not be whole blocks)."""

from __future__ import annotations

import json
from pathlib import Path

from shardsync.presets import PRESETS

STRADDLE = PRESETS["tiny-qwen3-fp8"].replace(name="tiny-qwen3-fp8-straddle", num_heads=6, num_kv_heads=2)


def straddle_config(directory: Path) -> str:
    """Its ``config.json`` in ``directory`` (engines and demos take a path): the path."""
    path = directory / "config.json"
    path.write_text(json.dumps(STRADDLE.to_hf_config()))
    return str(path)
