"""The copy kernel between two processes on one GPU: does writing another process's memory,
or that process queueing work behind ours, slow the copy down?

One ``Gather`` over a model's engine-layout tensor sizes (contiguous copies, the bytes of the
model), timed with CUDA events in this process, into: (a) memory of this process; (b) memory
a second process allocated and exported (CUDA IPC), that process idle; (c) the same, while
the second process's stream waits on an event recorded after our copy (what a commit in
stream order does); (d) the second process running the same gather, reading our memory
(the map path), while our stream waits on its event.  Prints a table, writes JSON.

    python benchmarks/ipc_contexts.py --model Qwen3-4B --out ipc_contexts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from shardsync.layout import EngineParallel, engine_layout
from shardsync.presets import load_spec
from shardsync.transport import events
from shardsync.transport.gather import Gather
from shardsync.transport.handles import export_tensors, open_set


def _sizes(model: str) -> list[int]:
    spec = load_spec(model, dtype="bfloat16")
    return [t.numel for t in engine_layout(spec, EngineParallel(tp=1, dtype="bfloat16")).ranks[0].tensors]


def _child(sizes: list[int], inbox, outbox) -> None:
    torch.cuda.set_device(0)
    mine = {str(i): torch.empty(n, dtype=torch.bfloat16, device="cuda") for i, n in enumerate(sizes)}
    outbox.put(export_tensors(mine, events.handle_of(_recorded(), torch.device("cuda", 0))))
    theirs, theirs_done, _ = open_set(inbox.get())
    opened = events.Opened()
    parent_done = opened.of_handle(theirs_done)
    pull = Gather([(mine[k], theirs[k]) for k in mine])
    tick = torch.zeros(1, device="cuda")
    while True:
        cmd = inbox.get()
        if cmd == "stop":
            return
        if cmd == "wait":  # queue work behind the parent's copy (its event is recorded already)
            torch.cuda.current_stream().wait_event(parent_done)
            tick += 1
            outbox.put("queued")
        elif cmd == "pull":  # timed here: the parent's stream waits on our event meanwhile
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pull.run()
            end.record()
            assert _done is not None  # set by _recorded() above
            _done.record()
            outbox.put("queued")
            torch.cuda.synchronize()
            outbox.put(start.elapsed_time(end))
        torch.cuda.synchronize()


_done: torch.cuda.Event | None = None


def _recorded() -> torch.cuda.Event:
    global _done
    _done = events.new_event()
    _done.record()
    return _done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="ipc_contexts.json")
    args = ap.parse_args()
    sizes = _sizes(args.model)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(sizes, inbox, outbox), daemon=True)
    child.start()
    src = {str(i): torch.randn(n, device="cuda").to(torch.bfloat16) for i, n in enumerate(sizes)}
    local = {k: torch.empty_like(t) for k, t in src.items()}
    mine_done = events.new_event()
    mine_done.record()
    inbox.put(export_tensors(src, events.handle_of(mine_done, torch.device("cuda", 0))))
    theirs, theirs_done, _ = open_set(outbox.get(timeout=300))
    child_done = events.Opened().of_handle(theirs_done)
    nbytes = sum(sizes) * 2
    into = {"local": Gather([(local[k], src[k]) for k in src]), "ipc": Gather([(theirs[k], src[k]) for k in src])}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    tick = torch.zeros(1, device="cuda")

    def timed(case: str) -> float:
        torch.cuda.synchronize()
        if case == "pull":
            inbox.put("pull")
            assert outbox.get(timeout=60) == "queued"
            torch.cuda.current_stream().wait_event(child_done)
            tick.add_(1)
            return outbox.get(timeout=60)
        start.record()
        into["local" if case == "local" else "ipc"].run()
        end.record()
        if case == "ipc+wait":
            mine_done.record()
            inbox.put("wait")
            assert outbox.get(timeout=60) == "queued"
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    flat_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    rows = {}
    run: Callable[[], float]  # the variants below bind different defaults, each called with none
    for case in ("d2d", "local", "ipc", "ipc+wait", "pull"):
        if case == "d2d":
            fn = lambda: flat_dst.copy_(flat_src)  # noqa: E731

            def run(fn=fn) -> float:
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                return start.elapsed_time(end)
        else:
            def run(case=case) -> float:
                return timed(case)
        for _ in range(3):
            run()
        rows[case] = statistics.median(run() for _ in range(args.iters))
    inbox.put("stop")
    child.join(30)
    names = {"d2d": "one flat D2D copy", "local": "gather into this process's memory",
             "ipc": "gather into the other process's memory (it idles)",
             "ipc+wait": "... while its stream waits on our event",
             "pull": "the other process gathers from ours (map), our stream waiting on its event"}
    print(f"\n{args.model}: {nbytes / 2**30:.2f} GiB, {len(sizes)} tensors, {torch.cuda.get_device_name()}")
    print("\n| copy | median ms | x D2D |\n|---|---|---|")
    for case, ms in rows.items():
        print(f"| {names[case]} | {ms:.2f} | {ms / rows['d2d']:.3f} |")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "model": args.model, "bytes": nbytes, "ms": rows}, f, indent=2)


if __name__ == "__main__":
    main()
