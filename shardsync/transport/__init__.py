"""Transports: standalone process groups that move flat buffers between trainer and engines."""

from shardsync.transport.group import SyncGroup

__all__ = ["SyncGroup"]
