"""Entry point vLLM runs in its API server, engine core and worker processes: registers the
``shardsync`` weight-transfer backend (selected with ``--weight-transfer-config
'{"backend": "shardsync"}'``).  Imports nothing of shardsync until a worker builds it."""

from __future__ import annotations

NAME = "shardsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if NAME not in WeightTransferEngineFactory._registry:  # plug-ins run once per process, or twice
        WeightTransferEngineFactory.register_engine(NAME, "shardsync.engines.vllm.backend", "ShardsyncEngine")
