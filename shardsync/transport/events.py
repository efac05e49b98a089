"""CUDA IPC events: one process's GPU work ordered after another's, neither CPU waiting.

The mapped path keeps one interprocess event per side.  The trainer records its event after
its last write and the engine's copies wait on it (instead of the trainer synchronizing
before it signals); the engine records its event after its copies and the trainer's stream
waits on it (instead of the engine synchronizing before it acks).  An event is re-recorded
every update; a wait always follows, in host order, the record it means, because each side
records before it signals and waits only after the other side's signal.

A handle is 64 bytes: it travels as base64 in a handle set (``EventHandle``) or as eight
int64 words after the device index in an ack tensor (``words`` / ``from_words``).
"""

from __future__ import annotations

import base64

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

HANDLE_BYTES = 64
WORDS = 1 + HANDLE_BYTES // 8  # device, then the handle


class EventHandle(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: int = Field(ge=0)
    handle: str  # base64 of the 64-byte cudaIpcEventHandle

    @field_validator("handle")
    @classmethod
    def _size(cls, v: str) -> str:
        if len(base64.b64decode(v, validate=True)) != HANDLE_BYTES:
            raise ValueError(f"an event handle is {HANDLE_BYTES} bytes")
        return v


def new_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=False, interprocess=True)


def handle_of(event: torch.cuda.Event, device: torch.device) -> EventHandle:
    return EventHandle(device=device.index or 0, handle=base64.b64encode(event.ipc_handle()).decode())


def words(event: torch.cuda.Event, device: torch.device) -> list[int]:
    """``WORDS`` int64 values: the device index, then the handle."""
    raw = torch.frombuffer(bytearray(event.ipc_handle()), dtype=torch.int64)
    return [device.index or 0, *raw.tolist()]


class Opened:
    """Events of other processes opened in this one, once per (device, handle)."""

    def __init__(self) -> None:
        self._events: dict[tuple[int, bytes], torch.cuda.Event] = {}
        self._by_words: dict[tuple[int, ...], torch.cuda.Event] = {}  # an ack's words, seen every update

    def get(self, device: int, raw: bytes) -> torch.cuda.Event:
        if len(raw) != HANDLE_BYTES or device < 0 or device >= torch.cuda.device_count():
            raise ValueError(f"not an event handle of this machine (device {device}, {len(raw)} bytes)")
        key = (device, raw)
        if key not in self._events:
            self._events[key] = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), raw)
        return self._events[key]

    def of_handle(self, h: EventHandle) -> torch.cuda.Event:
        return self.get(h.device, base64.b64decode(h.handle))

    def of_words(self, values: list[int]) -> torch.cuda.Event:
        key = tuple(values)
        hit = self._by_words.get(key)
        if hit is None:
            device, *rest = values
            hit = self._by_words[key] = self.get(int(device), torch.tensor(rest, dtype=torch.int64).numpy().tobytes())
        return hit

    def clear(self) -> None:
        self._events.clear()
        self._by_words.clear()
