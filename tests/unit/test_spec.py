"""Presets against figures published for the real models."""

from shardsync.presets import PRESETS


def test_qwen3_4b_parameter_count_matches_the_published_model() -> None:
    assert PRESETS["Qwen3-4B"].num_parameters() == 4_022_468_096
