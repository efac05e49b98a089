"""shardsync inside an unmodified SGLang: ``load`` is the custom weight loader SGLang runs in
every TP rank's scheduler (``--custom-weight-loader shardsync.engines.sglang.load``); it
hosts one ``Receiver`` per rank (``host``).  The trainer side is ``shardsync.control.sglang``."""

from shardsync.engines.sglang.loader import load

__all__ = ["load"]
