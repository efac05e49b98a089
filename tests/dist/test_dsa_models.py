"""What only sparse attention's families have: an indexer whose choice shapes every layer, and
GLM-5's shared-indexer layers that a pipeline stage cannot start on.  Their models against
transformers, decode and parallel worlds run in the family suite (``test_family_models.py``,
row ``dsa``)."""

from __future__ import annotations

import pytest

from shardsync.layout import MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel
from shardsync.presets import PRESETS
from tests.dist._compare import rel
from tests.dist.test_family_models import GLM5_SHARED, ids, source


def test_the_indexer_choice_matters() -> None:
    """Against the same model attending densely (top-k above the sequence), the logits move: the
    family suite's comparisons would catch an indexer that chose wrong."""
    spec = PRESETS["tiny-glm5"]
    sparse = EngineModel.from_source(spec, source(spec))(ids(spec))
    dense = EngineModel.from_source(spec.replace(index_topk=64), source(spec))(ids(spec))
    assert rel(sparse, dense) > 1e-3


def test_a_pipeline_stage_cannot_start_on_a_shared_layer() -> None:
    with pytest.raises(ValueError, match="move the stage boundary"):
        TrainerModel(GLM5_SHARED, MegatronParallel(pp=2, pp_layers=(2, 2)), rank=1, source=source(GLM5_SHARED))
