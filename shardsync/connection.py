"""What one ``connect`` agrees on, the same on every trainer rank (``Connection``), and how
the trainer ranks reach it (``agree``): plan the paths for the engines' layout, offer the plan,
and take whole tensors by broadcast once if an engine says the plan is not its layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

from shardsync.config import SyncConfig
from shardsync.control.client import EngineClient, SyncError
from shardsync.control.connect import topology_of
from shardsync.control.hosted import LAYOUT_MISMATCH
from shardsync.control.ranks import TrainerRanks
from shardsync.control.wire import Decision, Note
from shardsync.layout import Fsdp2Parallel, MegatronParallel
from shardsync.mode import Mode
from shardsync.paths import choose_full, connection_modes
from shardsync.receiver.connect import connect_request
from shardsync.spec import ModelSpec
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous
from shardsync.topology import Topology
from shardsync.vocab import Reason, Refused

log = logging.getLogger(__name__)


@dataclass
class Connection:
    """The plan, its paths and the store keys of its calls.  It outlives a dropped sync group
    (records and tests read it)."""

    topo: Topology
    mode: Mode  # the full-update path
    modes: tuple[Mode, ...]  # every path compiled
    fallback_reason: str | None
    keys: Keys


def agree(ranks: TrainerRanks, client: EngineClient | None, cfg: SyncConfig, spec: ModelSpec,
          parallel: MegatronParallel | Fsdp2Parallel, decision: Decision, rdv: Rendezvous, keys: Keys) -> Connection:
    """Choose the full path and offer the plan (rank 0 sends it through ``client``, every rank
    learns the answer).  A layout refusal that names the layout variants the engine's
    parameters are (SGLang's fused shared expert) is planned again for them, once; another
    falls back to whole tensors by broadcast, once, unless the config asked for p2p or
    colocated IPC; any other refusal ends the connect."""
    refused: str | None = None
    whole, replanned = False, False
    while True:
        topo = topology_of(decision, spec, parallel, relay=cfg.relay, whole=whole, lora=cfg.lora)
        mode, reason = (Mode.BROADCAST, refused) if whole else choose_full(topo, cfg.mode)
        if cfg.ipc and mode is not Mode.P2P:
            raise SyncError(f"colocated IPC needs the p2p path, but {reason}")
        conn = Connection(topo, mode, connection_modes(mode, cfg.delta.transport if cfg.delta else None),
                          reason, keys)
        offered = ranks.share(ranks.lead(partial(_offer, client, cfg, conn, rdv, len(decision.tps)), Note), Note)
        if not offered.error:
            return conn
        if whole or offered.reason is not Reason.LAYOUT_MISMATCH:
            raise SyncError(f"engines refused the connect: {offered.error}")
        if offered.variants and not replanned:
            decision, replanned = _with_variants(decision, offered.variants), True
            if ranks.rank == 0:
                log.info("shardsync: engines hold layout variants %s (engine index -> variants); planned again",
                         offered.variants)
            continue
        if cfg.mode == "p2p" or cfg.ipc:
            raise SyncError(f"engines refused the connect: {offered.error}")
        whole = True
        # the decision is the typed reason; the log line shows the engine's own words after it
        refused = f"{LAYOUT_MISMATCH}: {offered.error.partition(LAYOUT_MISMATCH + ': ')[2][:300] or offered.error}"


def _with_variants(decision: Decision, variants: dict[int, list[str]]) -> Decision:
    """The decision with the layout variants engines said their parameters are."""
    mine = list(decision.variants or [[] for _ in decision.tps])
    for i, v in variants.items():
        if not 0 <= i < len(mine):
            raise SyncError(f"an engine answered for engine {i} of {len(mine)}")
        mine[i] = v
    return decision.model_copy(update={"variants": mine})


def _offer(client: EngineClient | None, cfg: SyncConfig, conn: Connection, rdv: Rendezvous, engines: int) -> Note:
    """Rank 0: every engine gets the connection's plan fingerprints to check against its own."""
    if client is None:
        raise SyncError("only trainer rank 0 offers the plan")
    topo = conn.topo
    fingerprints = {m.value: topo.fingerprint(m.value) for m in conn.modes if not m.is_delta}
    t = cfg.transport
    try:
        client.connect([connect_request(topo, i, fingerprints, rdv, bucket_bytes=t.bucket_bytes, credits=t.credits,
                                        ipc=cfg.ipc, control=cfg.control.channel, verify=t.verify_buckets,
                                        delta=cfg.delta.transport if cfg.delta else None)
                        for i in range(engines)])
    except Refused as e:
        return Note(error=f"{type(e).__name__}: {e}", reason=e.reason, variants=e.variants)
    return Note()
