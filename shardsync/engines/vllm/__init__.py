"""shardsync inside an unmodified vLLM: a weight-transfer backend (``backend``) registered
by a ``vllm.general_plugins`` entry point (``plugin``), writing into vLLM's parameters or
through its loader (``params``).  The trainer side is ``shardsync.control.vllm``."""
