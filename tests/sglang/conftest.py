"""Tests against SGLang's own model classes, weight loaders and request schemas, run in
their own virtualenv by ``scripts/check_sglang.sh``; the main suite skips this folder when
SGLang is not installed."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["test_*.py"]
