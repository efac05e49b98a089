"""Tensor handles as typed JSON: a CPU export opens as the same memory, and anything that is
not a well-formed, in-bounds handle set is refused before a byte is mapped."""

from __future__ import annotations

import base64
import json
import os
import pickle

import pytest
import torch

from shardsync.transport.events import EventHandle
from shardsync.transport.handles import SEGMENT_HEADER, export_tensors, open_set, open_tensor, open_tensors
from shardsync.transport.mailbox import ACK, HEADER, Mailbox


def test_cpu_export_opens_the_same_memory_and_views() -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    view = base[1:, 2:5]  # a strided view with a storage offset
    opened = open_tensors(export_tensors({"base": base, "view": view}))
    assert torch.equal(opened["view"], view) and opened["view"].stride() == view.stride()
    opened["base"][0, 0] = -1.0  # shared memory: the exporter sees the write
    assert base[0, 0] == -1.0


def _blob(**change) -> str:
    d = json.loads(export_tensors({"t": torch.zeros(8)}))
    d["tensors"]["t"].update(change)
    return json.dumps(d)


class _Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled')",))


@pytest.mark.parametrize("blob,match", [
    (pickle.dumps(_Evil()), "no valid tensor handle set"),
    (b'{"tensors": {"t": {"kind": "gpu"}}}', "no valid tensor handle set"),
    (_blob(dtype="object"), "dtype 'object' is not one of"),
    (_blob(size=[9]), "reads past its storage"),
    (_blob(offset=4, size=[5]), "reads past its storage"),
    (_blob(size=[2, 2], stride=[-1, 1]), "size"),
    (_blob(extra=1), "no valid tensor handle set"),
    (b'{"tensors": {}, "written": {"device": 0, "handle": "AAAA"}}', "no valid tensor handle set"),  # 3 bytes
    (b'{"tensors": {}, "written": {"device": -1, "handle": "' + base64.b64encode(bytes(64)) + b'"}}',
     "no valid tensor handle set"),
])
def test_malformed_handles_are_refused(blob, match) -> None:
    with pytest.raises(ValueError, match=match):
        open_tensors(blob, where="key k")


def test_a_set_carries_its_writers_event_handle() -> None:
    """The written event travels with the tensors; a set without one opens with None."""
    h = EventHandle(device=0, handle=base64.b64encode(bytes(range(64))).decode())
    tensors, written, box = open_set(export_tensors({"t": torch.arange(4.0)}, h))
    assert written == h and box is None and torch.equal(tensors["t"], torch.arange(4.0))
    assert open_set(export_tensors({"t": torch.zeros(2)}))[1] is None


def test_a_set_carries_a_mailbox_both_ends_write() -> None:
    """The mailbox opens as its own mapping of the exporter's words (writes cross both ways);
    one that is not int64 host memory is refused before anything is mapped."""
    words = Mailbox.words()
    _, _, handle = open_set(export_tensors({"t": torch.zeros(2)}, mailbox=words))
    mine, theirs = Mailbox(words), Mailbox(open_tensor(handle))
    mine.post(HEADER, 1, [7, 1])
    assert theirs.take(HEADER, 2, after=0, timeout_s=1, what="header") == (1, [7, 1])
    theirs.post(ACK, 1, [7, 2, 9])
    assert mine.take(ACK, 3, after=0, timeout_s=1, what="ack") == (1, [7, 2, 9])
    bad = json.loads(export_tensors({"t": torch.zeros(2)}, mailbox=words))
    bad["mailbox"]["dtype"] = "float32"
    with pytest.raises(ValueError, match="mailbox that is not int64 host memory"):
        open_set(json.dumps(bad), where="key k")


def _b64s(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


@pytest.fixture
def foreign_segment():
    """Another process's shared-memory segment: a real /dev/shm file of 4160 bytes (a 4 KiB
    torch storage and its header), named as torch names its own."""
    path = f"/dev/shm/torch_1_4242_{torch.randint(1 << 30, ()).item()}"
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 16 + bytes(64))
    yield path
    os.unlink(path)


@pytest.mark.parametrize("change,match", [
    ({"storage_bytes": 1 << 30, "size": [1 << 28]}, "exceeds segment"),  # would grow it to 1 GiB
    ({"name": "/../../etc/passwd"}, "is not a torch shared-memory segment"),
    ({"name": "/torch_1_2_3/../../x"}, "is not a torch shared-memory segment"),
    ({"manager": "/etc/passwd"}, "is not a torch shared-memory manager socket"),
    ({"manager": "/tmp/../manager.sock"}, "is not a torch shared-memory manager socket"),
    ({"name": "/torch_1_2_999999999999"}, "no such segment"),
    ({"name": "bm90IGJhc2U2NA!"}, "tensor 't'"),  # not base64: named, not a 500
])
def test_crafted_cpu_handles_are_refused_before_mapping(foreign_segment: str, change: dict, match: str) -> None:
    before = open(foreign_segment, "rb").read()
    d = json.loads(export_tensors({"t": torch.zeros(8)}))
    h = d["tensors"]["t"]
    h["name"] = _b64s(foreign_segment.removeprefix("/dev/shm"))
    for k, v in change.items():
        h[k] = v if k not in ("name", "manager") or v.endswith("!") else _b64s(v)
    with pytest.raises(ValueError, match=match):
        open_tensors(json.dumps(d), where="key k")
    assert open(foreign_segment, "rb").read() == before and os.path.getsize(foreign_segment) == 4160


def test_torch_segments_carry_the_header_read_only_opens_skip() -> None:
    """``SEGMENT_HEADER`` is torch's: a shared storage's segment is its bytes plus the header."""
    t = torch.arange(1000, dtype=torch.float32)
    _, name, size = t.untyped_storage()._share_filename_cpu_()
    assert os.stat("/dev/shm" + name.decode()).st_size == size + SEGMENT_HEADER


def _write_read_only(blob: str, out) -> None:
    opened = open_set(blob, read_only=True).tensors
    out.put(("read", opened["base"].sum().item(), opened["view"].tolist()))
    out.close()
    out.join_thread()  # delivered before the write
    opened["base"][0, 0] = -1.0  # faults: the pages are mapped without write access


def test_a_read_only_open_reads_the_exporters_memory_and_cannot_write_it() -> None:
    """The map path's engine end: it sees the exporter's bytes (and later writes to them), but a
    write of its own kills it (SIGSEGV) instead of changing the trainer's weights."""
    import torch.multiprocessing as mp

    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    view = base[1:, 2:5]
    blob = export_tensors({"base": base, "view": view})
    base[3, 5] = 100.0  # after the export: a shared mapping sees it
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_write_read_only, args=(blob, out))
    p.start()
    p.join(60)
    assert p.exitcode == -11, p.exitcode  # SIGSEGV, the write did not land
    assert out.get(timeout=5) == ("read", base.sum().item(), view.tolist())
    assert base[0, 0] == 0.0


def test_a_read_only_open_refuses_a_size_that_is_not_the_segments() -> None:
    blob = _blob(storage_bytes=16, size=[4])  # the segment holds 32 bytes
    with pytest.raises(ValueError, match="storage_bytes 16 is not segment"):
        open_set(blob, read_only=True)
