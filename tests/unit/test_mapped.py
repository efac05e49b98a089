"""The mapped transport's handles: what must stay the same for a mapping to stay valid."""

import torch


def test_identity_changes_when_a_shared_cpu_tensor_is_replaced() -> None:
    """A CPU tensor's identity includes its shared-memory name, not only its address."""
    import torch.multiprocessing as tmp

    from shardsync.transport.colocated.exports import identity

    t = torch.arange(8.0)
    plain = identity(t)
    assert plain[1] is None
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # as export does (no pickle here: nothing to leak)
    try:
        t.share_memory_()
    finally:
        tmp.set_sharing_strategy(previous)
    shared = identity(t)
    assert shared[1] is not None and shared != plain and identity(t) == shared
    t.set_(torch.arange(8.0))  # reloaded into fresh, unshared memory
    assert identity(t) != shared and identity(t)[1] is None
