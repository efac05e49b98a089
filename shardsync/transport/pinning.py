"""Page-locking host memory another process shares with this one, so copies from it into a
GPU run as DMA at the link's speed (offloaded trainer weights read by a GPU engine).

Shared-memory pages mapped from another process are pageable here whatever they were
there: a copy from them into device memory goes through a staging buffer at a fraction of
the bandwidth.  ``HostPins`` registers each distinct storage once (``cudaHostRegister``) and
unregisters it before the mapping goes away.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the pages


class HostPins:
    def __init__(self) -> None:
        self._pinned: dict[int, int] = {}  # data pointer -> bytes

    def pin(self, tensors: Iterable[torch.Tensor], *, read_only: bool = False) -> int:
        """Register the CPU storages behind ``tensors`` (not yet pinned); returns bytes pinned.
        ``read_only``: pages mapped without write access (``cudaHostRegisterReadOnly``)."""
        if not torch.cuda.is_available():
            return 0
        cudart = torch.cuda.cudart()
        added = 0
        for t in tensors:
            if t.is_cuda:
                continue
            s = t.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
            if not nbytes or ptr in self._pinned or t.is_pinned():
                continue
            err = cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_READ_ONLY if read_only else 0)
            if int(err) != 0:  # not fatal: the copies still run, through pageable memory
                log.warning("cudaHostRegister of %d bytes failed (%s): host copies stay pageable", nbytes, err)
                continue
            self._pinned[ptr] = nbytes
            added += nbytes
        return added

    @property
    def nbytes(self) -> int:
        return sum(self._pinned.values())

    def release(self) -> None:
        if self._pinned:
            cudart = torch.cuda.cudart()
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
        self._pinned.clear()
