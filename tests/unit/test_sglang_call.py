"""A shardsync call as it rides SGLang's ``update_weights_from_tensor`` (``control.sglang``):
signed over everything, packed as the one uint8 tensor SGLang hands the loader, bounded."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from shardsync.control.client import SyncError
from shardsync.control.sglang import MAX_CALL_BYTES, SglangCall, payload, read_call, server_dtype

SECRET = "sglang-unit-secret-0123456789"


class _Restricted(pickle.Unpickler):
    """Admits only what the payload may need: a list, tuples, ``torch.ByteTensor``."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch", "ByteTensor"):
            return torch.ByteTensor
        raise pickle.UnpicklingError(f"{module}.{name} not admitted")


def _unpack(p: str):
    return _Restricted(io.BytesIO(base64.b64decode(p))).load()


def _call(**kw) -> SglangCall:
    return SglangCall(op="update", name="shardsync-1234", update={"seq": 1, "version": 3, "mode": "p2p"}, **kw)


def test_payload_is_one_uint8_tensor_that_reads_back_signed() -> None:
    items = _unpack(payload(_call().signed(SECRET)))
    assert [n for n, _ in items] == ["shardsync"] and items[0][1].dtype == torch.uint8
    call = read_call(items)
    assert call.verify(SECRET) and call.update["version"] == 3
    assert not call.verify("another-secret-0123456789")


def test_tampered_call_fails_its_signature() -> None:
    call = read_call(_unpack(payload(_call().signed(SECRET))))
    forged = call.model_copy(update={"update": {**call.update, "version": 4}})
    assert not forged.verify(SECRET)
    assert not _call().verify(SECRET)  # unsigned
    signed = _call(expires=100.0, nonces={"0": "ab" * 16}).signed(SECRET)
    for change in ({"expires": 1e12}, {"nonces": {"0": "cd" * 16}}, {"nonces": None}):
        assert not signed.model_copy(update=change).verify(SECRET), change  # expiry and nonces are signed too


def test_read_call_refuses_anything_else() -> None:
    with pytest.raises(ValueError, match="one tensor named"):
        read_call([("model.embed_tokens.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="uint8"):
        read_call([("shardsync", torch.zeros(4))])
    with pytest.raises(ValueError):
        read_call([("shardsync", torch.tensor(list(b'{"op": "format_disk"}'), dtype=torch.uint8))])
    with pytest.raises(ValueError, match="size bound"):
        read_call([("shardsync", torch.zeros(MAX_CALL_BYTES + 1, dtype=torch.uint8))])


def test_oversized_call_is_refused_before_sending() -> None:
    big = SglangCall(op="check", name="x", connect={"spec": {"name": "a" * MAX_CALL_BYTES}})
    with pytest.raises(ValueError, match="exceeds"):
        payload(big)


def test_server_dtype_must_be_named() -> None:
    assert server_dtype("http://e", "bfloat16") == "bfloat16" and server_dtype("http://e", "torch.float32") == "float32"
    with pytest.raises(SyncError, match="--dtype"):
        server_dtype("http://e", "auto")  # SGLang's default: resolved inside its scheduler, never reported


def test_the_served_adapter_is_read_off_server_info() -> None:
    """SGLang's ``--lora-paths`` entry as ``/server_info`` shows it: the adapter an adapter sync
    reloads by name; no entry, several, or a trainer syncing the whole model are refused by name."""
    from shardsync.control.adapters import lora_entry, sglang_served
    from shardsync.lora import Lora

    assert lora_entry("policy=/ckpt/adapter") == ("policy", "/ckpt/adapter")
    assert lora_entry({"lora_name": "policy", "lora_path": "/a", "pinned": False}) == ("policy", "/a")
    assert lora_entry("/ckpt/adapter") is None and lora_entry(7) is None
    lora = Lora(8, 16.0)
    served, entry = sglang_served("u", {"enable_lora": True, "lora_paths": ["policy=/a"]}, lora)
    assert entry == ("policy", "/a") and served == lora
    assert sglang_served("u", {"enable_lora": False, "lora_paths": ["policy=/a"]}, lora) == (None, None)
    for paths in ([], ["a=/a", "b=/b"], ["/bare"]):
        with pytest.raises(SyncError, match="shardsync syncs one adapter"):
            sglang_served("u", {"enable_lora": True, "lora_paths": paths}, lora)
    with pytest.raises(SyncError, match="SGLang serves LoRA adapters"):  # a whole-model sync into it
        sglang_served("u", {"enable_lora": True, "lora_paths": ["policy=/a"]}, None)
