"""Every key one sync uses in its store, under the sync's name: the one list of what the
store holds (``docs/architecture.md`` lists them with their writers)."""

from __future__ import annotations


class Keys:
    """Every key one sync uses in its store, under the sync's name."""

    def __init__(self, name: str) -> None:
        self.name = name

    # engine control (control="store"): update ``seq`` counted from 1 per connection
    def begin(self, seq: int) -> str:
        return f"{self.name}/ctl/{seq}/begin"

    def accepted(self, seq: int, engine: int) -> str:
        return f"{self.name}/ctl/{seq}/accepted/{engine}"

    def result(self, seq: int, engine: int) -> str:
        return f"{self.name}/ctl/{seq}/result/{engine}"

    # engines whose ranks answer for themselves (vLLM workers): one value per engine rank
    def rank_result(self, seq: int, engine: int, rank: int) -> str:
        return f"{self.name}/ctl/{seq}/result/{engine}/{rank}"

    def rank_checked(self, attempt: int, engine: int, rank: int) -> str:
        """A rank's answer to connect check ``attempt`` (engines whose calls return nothing: SGLang)."""
        return f"{self.name}/checked/{attempt}/{engine}/{rank}"

    def rank_joined(self, engine: int, rank: int) -> str:
        return f"{self.name}/joined/{engine}/{rank}"

    def rank_checksums(self, seq: int, engine: int, rank: int) -> str:
        return f"{self.name}/ck/{seq}/{engine}/{rank}"

    def alive(self, engine: int, rank: int) -> str:
        """The heartbeat counter of engine ``engine``'s rank ``rank`` (``liveness``)."""
        return f"{self.name}/alive/{engine}/{rank}"

    # trainer ranks: call ``n`` on this connection
    def go(self, n: int) -> str:
        return f"{self.name}/u{n}/begin"

    def done(self, n: int) -> str:
        return f"{self.name}/u{n}/done"

    def written(self, n: int) -> str:
        """Prefix of every trainer rank's ``Note`` (``/<rank>`` appended) after a disk write."""
        return f"{self.name}/u{n}/written"

    def closed(self, n: int) -> str:
        return f"{self.name}/u{n}/closed"

    def check(self, n: int, what: str) -> str:
        return f"{self.name}/ck{n}/{what}"

    # colocated transports: handles of ``src``'s tensors (generation) or slots for ``dst``
    def mapped(self, src: int, dst: int, generation: int) -> str:
        return f"{self.name}/map/{src}->{dst}/g{generation}"

    def slots(self, src: int, dst: int) -> str:
        return f"{self.name}/ipc/{src}->{dst}"

    def staging(self, src: int, dst: int) -> str:
        """Handles of engine sync rank ``src``'s staging copies that trainer rank ``dst`` writes (push)."""
        return f"{self.name}/push/{src}->{dst}"

    def signals(self, src: int, dst: int) -> str:
        """How a mapped link signals, as its engine end chose at connect (``mailbox`` or ``group``)."""
        return f"{self.name}/map/{src}->{dst}/signals"
