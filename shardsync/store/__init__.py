"""The bottom room: the sync's rendezvous store and what is written to it.

Every member of a sync meets in one TCPStore that trainer rank 0 hosts (``rendezvous``);
every key one sync uses is named in one place (``keys``); a value a peer acts on is sealed
with the shared secret (``sealed``, keyed by ``auth``).  Rooms above (transport, control,
receiver, trainer) import from here; this room imports no other.
"""

from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.store.sealed import get, put, seal, unseal

__all__ = ["Keys", "Rendezvous", "free_port", "get", "open_store", "put", "seal", "unseal"]
