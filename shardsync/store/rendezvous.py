"""Where the members of one sync meet: a TCPStore hosted by trainer rank 0 on one address,
on a port picked free at connect (never a fixed one)."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the members of one sync meet; sent to engines at connect."""

    host: str
    port: int
    world_size: int
    name: str
    backend: str = "gloo"
    timeout_s: float = 60.0

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on ``host`` now (rendezvous and servers never use fixed
    ports; the caller binds it soon after, and a lost race fails that bind loudly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_store(rdv: Rendezvous, *, is_master: bool) -> dist.TCPStore:
    """The sync's TCPStore: hosted by the master on ``rdv.host`` only (torch's own server
    would listen on every interface), joined by everybody else."""
    if not is_master:
        return dist.TCPStore(rdv.host, rdv.port, None, False, timeout=rdv.timeout, wait_for_workers=False)
    family = socket.AF_INET6 if ":" in rdv.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((rdv.host, rdv.port))
        sock.listen(1024)
        store = dist.TCPStore(rdv.host, rdv.port, rdv.world_size, True, timeout=rdv.timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except Exception:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store
