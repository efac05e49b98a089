"""Model families as declarative tables: one module per family (its config fields, its
blocks, its flags), the shared blocks in ``blocks.py``, the table vocabulary in
``table.py``.  A new family is a module here and a line in ``FAMILIES``."""

from shardsync.family.deepseek import DEEPSEEK_V3, GLM4_MOE_LITE
from shardsync.family.dsa import DEEPSEEK_V32, GLM_MOE_DSA
from shardsync.family.glm4 import GLM4, GLM4_MOE
from shardsync.family.llama import LLAMA
from shardsync.family.qwen import QWEN2, QWEN3, QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT
from shardsync.family.table import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2, QWEN3, LLAMA, QWEN3_MOE, GLM4, GLM4_MOE,
                                                    DEEPSEEK_V3, GLM4_MOE_LITE, DEEPSEEK_V32, GLM_MOE_DSA,
                                                    QWEN3_NEXT, QWEN3_5_MOE)}
ARCHITECTURES: dict[str, str] = {f.architecture: f.name for f in FAMILIES.values()}
MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.is_moe)

__all__ = ["ARCHITECTURES", "FAMILIES", "MOE_FAMILIES", "Family"]
