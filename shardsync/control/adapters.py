"""The adapter view's control side: what an engine's HTTP facts say of the adapter it serves,
and what SGLang needs after a commit (a reload of the adapter it keeps in memory).  Neither
vLLM's nor SGLang's facts say the adapter's rank: an engine serving adapters is taken to serve
the trainer's, and its every rank checks that claim at connect against the adapter directory
it loads (``engines.vllm.adapter``, ``engines.sglang.adapter``), refusing another by name."""

from __future__ import annotations

from collections.abc import Sequence

from shardsync.control.client import Engines, SyncError
from shardsync.lora import Lora


def vllm_served(url: str, cfg: dict, synced: Lora | None) -> Lora | None:
    """The adapter a vLLM serves, from its ``vllm_config`` (``cfg``); ``synced``: the trainer's."""
    if cfg.get("lora_config") is None:
        return None
    if synced is None:
        raise SyncError(f"{url}: vLLM serves LoRA adapters (--enable-lora): shardsync syncs its adapter alone; "
                        "set SyncConfig(lora=Lora(rank, alpha, targets)) to the adapter it serves (docs/lora.md)")
    return synced


def sglang_served(url: str, raw: dict, synced: Lora | None) -> tuple[Lora | None, tuple[str, str] | None]:
    """The adapter an SGLang serves and its one ``--lora-paths`` entry (name, directory), from
    its ``/server_info`` (``raw``); ``synced``: the trainer's."""
    if not raw.get("enable_lora"):
        return None, None
    entries = [lora_entry(e) for e in raw.get("lora_paths") or []]
    if synced is None or len(entries) != 1 or entries[0] is None:
        raise SyncError(f"{url}: SGLang serves LoRA adapters ({raw.get('lora_paths')}): shardsync syncs one "
                        "adapter, given as --lora-paths NAME=DIR, with SyncConfig(lora=Lora(rank, alpha, "
                        "targets)) of it (docs/lora.md)")
    return synced, entries[0]


def lora_entry(entry: object) -> tuple[str, str] | None:
    """(name, directory) of one ``--lora-paths`` entry as ``/server_info`` shows it (``NAME=DIR``,
    or a dict with ``lora_name`` and ``lora_path``), None for a bare path."""
    if isinstance(entry, dict) and isinstance(entry.get("lora_name"), str) and isinstance(entry.get("lora_path"), str):
        return entry["lora_name"], entry["lora_path"]
    if isinstance(entry, str) and "=" in entry:
        name, _, path = entry.partition("=")
        return name, path
    return None


def sglang_crossing(synced: Lora | None, pause_mode: str) -> None:
    """Refuse a pause that keeps requests across an adapter sync: SGLang reloads the adapter
    under a new id, and a retracted request keeps the old one."""
    if synced is not None and pause_mode == "retract":
        raise ValueError("an adapter sync into SGLang reloads the adapter, under a new id; a retracted request "
                         "keeps the old one: use crossing='abort' (the default) for adapter syncs into SGLang")


def sglang_reload(http: Engines, served: Sequence[tuple[str, str] | None]) -> None:
    """Have every SGLang that serves an adapter (``served``: per engine, its entry) load it again,
    under the same name: it keeps a loaded adapter in memory, and the commit wrote the new
    version into its directory.  Generation is paused meanwhile."""
    for i, entry in enumerate(served):
        if entry is None:
            continue
        name, path = entry
        for route, body in (("/unload_lora_adapter", {"lora_name": name}),
                            ("/load_lora_adapter", {"lora_name": name, "lora_path": path})):
            answer = http.call_one(i, "POST", route, body)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise SyncError(f"{http.urls[i]}{route}: {answer.get('error_message') or answer}")
