"""``shardsync demo``: a few GRPO steps between a reference trainer and engine servers."""

from shardsync.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
