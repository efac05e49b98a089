"""The function SGLang imports and calls with its live model: ``load(model, named_tensors)``.

One shardsync call (``control.sglang.SglangCall``) arrives per invocation, signed.  SGLang
ignores the return value and dies on an exception, so nothing escapes: every failure is
logged here and reported to the trainer through the sync group's store.
"""

from __future__ import annotations

import logging

import torch

from shardsync.control.sglang import read_call
from shardsync.engines.sglang.host import SglangHost

log = logging.getLogger(__name__)

_hosts: dict[int, SglangHost] = {}  # by id(model): one per model this process serves


def load(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight-loader entry point; never raises."""
    try:
        call = read_call(named_tensors)
    except Exception as e:
        log.warning("shardsync: ignored a weight load that is not a shardsync call: %s", e)
        return
    try:
        host = _hosts.get(id(model))
        if host is None or host.model is not model:
            host = _hosts[id(model)] = SglangHost(model)
        host.run(call)
    except Exception as e:  # a bug of ours must not take SGLang down
        log.exception("shardsync: %s call failed: %s", call.op, e)
