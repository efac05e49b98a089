"""Receivers hosted inside real rollout engines, one package per engine (``vllm``)."""
