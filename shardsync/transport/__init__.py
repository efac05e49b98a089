"""Transports: standalone process groups that move flat buffers between trainer and engines."""

from shardsync.transport.group import Rendezvous, SyncGroup

__all__ = ["Rendezvous", "SyncGroup"]
