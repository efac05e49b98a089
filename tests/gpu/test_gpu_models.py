"""Collects the GPU checks of ``check_models.py`` (marked ``gpu``: run with ``pytest -m gpu``)."""

import pytest

from tests.gpu.check_models import (  # noqa: F401
    test_engine_and_trainer_match_transformers_bf16,
    test_trainer_matches_megatron_core,
)

pytestmark = pytest.mark.gpu
