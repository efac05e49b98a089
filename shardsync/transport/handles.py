"""Tensor handles another process on this machine can open: CUDA IPC or CPU shared memory,
as typed JSON fields (never a pickle).

``export_tensor`` describes a tensor by its storage's IPC handle (CUDA) or shared-memory
name (CPU, moved into shared memory first) plus size, stride and offset; ``open_tensor``
validates such a description and rebuilds the tensor with a fixed set of torch calls, the
dtype taken from an allow-list.  Each export holds one reference for its one reader, as
torch's own pickling does (a description opened twice would release it twice).  A reader that
only reads (the engine of the map path) opens CPU segments read-only: a stray write of its
own faults instead of changing the trainer's weights.
"""

from __future__ import annotations

import base64
import mmap
import os
import re
import stat
import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch
import torch.multiprocessing as tmp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardsync.dtypes import TORCH_DTYPES
from shardsync.transport.events import EventHandle

DTYPES = TORCH_DTYPES  # the dtypes a handle may name
SHM_DIR = "/dev/shm"
# torch's ``file_system`` sharing: segments ``/torch_<pid>_<random>_<n>``, and its manager's socket
SEGMENT = re.compile(r"/torch_[0-9]+_[0-9]+_[0-9]+")
MANAGER = re.compile(r"/[A-Za-z0-9_./-]+/manager\.sock")
# torch's refcounted segments start with their counter, this many bytes before the data
SEGMENT_HEADER = 64


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _raw(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s, validate=True)


class TensorHandle(BaseModel):
    """One exported tensor: where its storage lives and how the tensor views it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["cuda", "cpu"]
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = Field(ge=0)  # in elements, into the storage
    storage_bytes: int = Field(ge=0)
    # cuda: the allocation's IPC handle, its ref counter and event (torch's _share_cuda_ fields)
    device: int = Field(0, ge=0)
    handle: str | None = None
    storage_offset_bytes: int = Field(0, ge=0)
    ref_counter_handle: str | None = None
    ref_counter_offset: int = Field(0, ge=0)
    event_handle: str | None = None
    event_sync_required: bool = False
    # cpu: the shared-memory manager socket and the storage's name
    manager: str | None = None
    name: str | None = None


class HandleSet(BaseModel):
    """Named handles of one exporter for one reader (a store value)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensors: dict[str, TensorHandle]
    written: EventHandle | None = None  # recorded after the exporter's writes (``transport.events``)
    mailbox: TensorHandle | None = None  # the link's signal words (``transport.mailbox``), first set only


class OpenedSet(NamedTuple):
    tensors: dict[str, torch.Tensor]
    written: EventHandle | None
    mailbox: TensorHandle | None  # opened by the caller, which may fall back where it cannot


def export_tensor(t: torch.Tensor) -> TensorHandle:
    """A handle of ``t`` for one reader (CPU tensors move into shared memory, in place)."""
    # the view's fields, validated by ``TensorHandle`` (mixed value types: Any)
    common: dict[str, Any] = dict(dtype=str(t.dtype).removeprefix("torch."), size=tuple(t.shape),
                                  stride=tuple(t.stride()), offset=t.storage_offset())
    storage = t.untyped_storage()
    if t.is_cuda:
        (device, handle, size, offset, rc_handle, rc_offset, event, sync) = storage._share_cuda_()
        return TensorHandle(kind="cuda", storage_bytes=size, device=device, handle=_b64(handle),
                            storage_offset_bytes=offset, ref_counter_handle=_b64(rc_handle),
                            ref_counter_offset=rc_offset, event_handle=_b64(event),
                            event_sync_required=bool(sync), **common)
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # a name, not a file descriptor: fits in a store value
    try:
        storage.share_memory_()
        manager, name, size = storage._share_filename_cpu_()
    finally:
        tmp.set_sharing_strategy(previous)
    storage._shared_incref()  # the reader's reference; ``open_tensor`` takes it over
    return TensorHandle(kind="cpu", storage_bytes=size, manager=_b64(manager), name=_b64(name), **common)


def export_tensors(tensors: Mapping[str, torch.Tensor], written: EventHandle | None = None,
                   mailbox: torch.Tensor | None = None) -> str:
    """JSON of a ``HandleSet`` for one reader."""
    return HandleSet(tensors={k: export_tensor(t) for k, t in tensors.items()}, written=written,
                     mailbox=None if mailbox is None else export_tensor(mailbox)).model_dump_json()


def _storage(h: TensorHandle, opened: dict, read_only: bool) -> torch.UntypedStorage:
    key: tuple[str, int] | tuple[str]  # (IPC handle, offset) or (shm name,): one mapping per storage
    if h.kind == "cuda":
        if h.handle is None or h.ref_counter_handle is None:
            raise ValueError("a CUDA tensor handle needs handle and ref_counter_handle")
        key = (h.handle, h.storage_offset_bytes)
        if key in opened:  # already mapped by this set: release the extra counter as torch does
            torch.UntypedStorage._release_ipc_counter(_raw(h.ref_counter_handle), h.ref_counter_offset,
                                                      device=h.device)
            return opened[key]
        torch.cuda._lazy_init()
        s = torch.UntypedStorage._new_shared_cuda(h.device, _raw(h.handle), h.storage_bytes,
                                                  h.storage_offset_bytes, _raw(h.ref_counter_handle),
                                                  h.ref_counter_offset, _raw(h.event_handle),
                                                  h.event_sync_required)
    else:
        if h.manager is None or h.name is None:
            raise ValueError("a CPU tensor handle needs manager and name")
        key = (h.name,)
        if key in opened:
            held, view = opened[key]
            held._shared_decref()
            return view
        manager, name, segment_bytes = _cpu_segment(h)
        s = torch.UntypedStorage._new_shared_filename_cpu(manager, name, h.storage_bytes)
        s._shared_decref()  # the exporter's reference for this reader, now held by the mapping
        # read-only: a second mapping of the same pages; torch's (the reference count) goes with
        # the opened set, the segment's pages stay while this mapping does
        opened[key] = (s, _read_only(name, segment_bytes, h.storage_bytes) if read_only and h.storage_bytes else s)
        return opened[key][1]
    opened[key] = s
    return s


def _read_only(name: bytes, segment_bytes: int, storage_bytes: int) -> torch.UntypedStorage:
    if segment_bytes != storage_bytes + SEGMENT_HEADER:
        raise ValueError(f"storage_bytes {storage_bytes} is not segment {name.decode()}'s ({segment_bytes} bytes "
                         f"with its {SEGMENT_HEADER}-byte header)")
    fd = os.open(SHM_DIR + name.decode(), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        pages = mmap.mmap(fd, segment_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # not writable is the point: writes fault instead of landing
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(pages, dtype=torch.uint8, count=storage_bytes,
                                offset=SEGMENT_HEADER).untyped_storage()


def _cpu_segment(h: TensorHandle) -> tuple[bytes, bytes, int]:
    """(manager, name, segment bytes) of a CPU handle, checked against the machine before anything is mapped:
    a torch segment name (no path of its own), a real segment in /dev/shm at least as large as the
    handle claims (mapping a larger claim would grow another process's segment), a socket."""
    manager, name = _raw(h.manager), _raw(h.name)
    assert manager is not None and name is not None
    text, sock = name.decode(errors="replace"), manager.decode(errors="replace")
    if not SEGMENT.fullmatch(text):
        raise ValueError(f"name {text[:80]!r} is not a torch shared-memory segment (/torch_<pid>_<n>_<n>)")
    if not MANAGER.fullmatch(sock) or ".." in sock.split("/"):
        raise ValueError(f"manager {sock[:120]!r} is not a torch shared-memory manager socket")
    try:
        fd = os.open(SHM_DIR + text, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"name {text!r}: no such segment ({e.strerror})") from None
    try:
        seg = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(seg.st_mode) or seg.st_size < h.storage_bytes:
        raise ValueError(f"storage_bytes {h.storage_bytes} exceeds segment {text} ({seg.st_size} bytes)")
    try:
        if not stat.S_ISSOCK(os.stat(sock).st_mode):
            raise ValueError(f"manager {sock!r} is not a socket")
    except OSError as e:
        raise ValueError(f"manager {sock!r}: {e.strerror}") from None
    return manager, name, seg.st_size


def open_tensor(h: TensorHandle, opened: dict | None = None, *, read_only: bool = False) -> torch.Tensor:
    """The tensor ``h`` describes, mapped into this process (bounds checked first); ``read_only``:
    a CPU tensor's pages cannot be written here (CUDA IPC has no read-only mapping)."""
    if h.dtype not in DTYPES:
        raise ValueError(f"tensor handle dtype {h.dtype!r} is not one of {sorted(DTYPES)}")
    if len(h.size) != len(h.stride) or any(s < 0 for s in h.size) or any(s < 0 for s in h.stride):
        raise ValueError(f"tensor handle has size {h.size} and stride {h.stride}")
    dtype = DTYPES[h.dtype]
    item = torch.empty((), dtype=dtype).element_size()
    last = h.offset + sum((n - 1) * s for n, s in zip(h.size, h.stride, strict=True)) if all(h.size) else -1
    if (last + 1) * item > h.storage_bytes:
        raise ValueError(f"tensor handle reads past its storage ({(last + 1) * item} > {h.storage_bytes} bytes)")
    storage = _storage(h, {} if opened is None else opened, read_only)
    device = f"cuda:{h.device}" if h.kind == "cuda" else "cpu"
    t = torch.empty((0,), dtype=dtype, device=device)
    return t.set_(storage, h.offset, h.size, h.stride)


def open_tensors(blob: str | bytes, *, where: str = "the store") -> dict[str, torch.Tensor]:
    """Tensors of a ``HandleSet`` JSON; a ``ValueError`` naming ``where`` for anything else
    (nothing is opened then)."""
    return open_set(blob, where=where)[0]


def open_set(blob: str | bytes, *, where: str = "the store", read_only: bool = False) -> OpenedSet:
    """``open_tensors``, the set's ``written`` event handle and its mailbox handle (None when
    it has none); ``read_only``: as ``open_tensor``'s (the mailbox is opened by its reader)."""
    try:
        handles = HandleSet.model_validate_json(blob)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{where} holds no valid tensor handle set ({first['msg']} at "
                         f"{'.'.join(map(str, first['loc'])) or 'top level'}); refusing to map it") from None
    if handles.mailbox is not None and (handles.mailbox.kind != "cpu" or handles.mailbox.dtype != "int64"):
        raise ValueError(f"{where} holds a mailbox that is not int64 host memory; refusing to map it")
    opened: dict = {}
    tensors = {}
    for k, h in handles.tensors.items():
        try:
            tensors[k] = open_tensor(h, opened, read_only=read_only)
        except (ValueError, RuntimeError) as e:  # torch's own refusals too: the sender's fault, named
            raise ValueError(f"{where}: tensor {k[:200]!r}: {e}; refusing to map it") from None
    return OpenedSet(tensors, handles.written, handles.mailbox)
