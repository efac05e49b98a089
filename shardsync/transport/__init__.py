"""Transports: standalone process groups that move flat buffers between trainer and engines."""

from shardsync.transport.group import Rendezvous, SyncGroup, free_port

__all__ = ["Rendezvous", "SyncGroup", "free_port"]
