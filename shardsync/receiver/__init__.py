"""The engine side of a sync as a library: any engine process hosts a ``Receiver`` per rank,
writing into its parameters in place (``Params``) or through its own loader (``Loader``).
Imports no web framework and nothing of the reference engine."""

from shardsync.receiver.connect import (
    check_connect,
    connect_request,
    spec_from_dict,
    topology_from_connect,
)
from shardsync.receiver.destination import Destination, Loader, Params, Slice, Staged
from shardsync.receiver.receiver import Receiver

__all__ = ["Destination", "Loader", "Params", "Receiver", "Slice", "Staged", "check_connect", "connect_request",
           "spec_from_dict", "topology_from_connect"]
