"""Per-step table, summary and plot of a demo run."""

from __future__ import annotations

import statistics
from pathlib import Path


def header(modes: list[str]) -> str:
    cols = [f"{'step':>4} {'reward':>7} {'grad norm':>9}"]
    for m in modes:
        cols.append(f"{m + ' ms':>13} {'pause ms':>8} {'pack/xfer/unpack/ctl ms':>25} {'busiest KiB':>11} "
                    f"{'|lp diff|':>9}")
    cols.append(f"{'rollout |lp diff|':>17} {'checksum':>8}")
    return " ".join(cols)


def row(r: dict, modes: list[str]) -> str:
    cols = [f"{r['step']:>4} {r['reward']:>7.3f} {r['grad_norm']:>9.3f}"]
    for m in modes:
        u = r["updates"][m]
        p = u["phases"]
        lp = u.get("logprob_abs_diff")
        cols.append(f"{p['total'] * 1e3:>13.1f} {u.get('pause_s', 0.0) * 1e3:>8.2f} "
                    f"{'/'.join(f'{p[k] * 1e3:.1f}' for k in ('pack', 'transfer', 'unpack', 'control')):>25} "
                    f"{u['busiest_link_bytes'] / 1024:>11.1f} "
                    + (f"{lp:>9.2e}" if lp is not None else f"{'-':>9}"))
    oks = [u["checksum_ok"] for u in r["updates"].values()]
    ok = "skipped" if None in oks else "ok" if all(oks) else "MISMATCH"
    cols.append(f"{r['logprob_abs_diff']:>17.2e} {ok:>8}")
    paths = {u.get("path") for m, u in r["updates"].items() if m == "delta"}
    if paths:
        u = r["updates"]["delta"]
        sent = (u.get("delta") or {}).get("bytes_sent")
        cols.append(f"  {paths.pop()}" + (f" ({sent / 1024:.1f} KiB sent by rank 0)" if sent else ""))
    return " ".join(cols)


def summary(rows: list[dict], modes: list[str]) -> list[str]:
    out = []
    med = {m: statistics.median(r["updates"][m]["phases"]["total"] for r in rows) for m in modes}
    for m in modes:
        pause = statistics.median(r["updates"][m].get("pause_s", 0.0) for r in rows)
        out.append(f"median {m} update: {med[m] * 1e3:.1f} ms, engine pause {pause * 1e3:.2f} ms")
    if "p2p" in med and "broadcast" in med:
        out.append(f"p2p / broadcast update time: {med['p2p'] / med['broadcast']:.2f}")
    lps = {m: [r["updates"][m].get("logprob_abs_diff") for r in rows] for m in modes}
    if all(v is not None for vals in lps.values() for v in vals):
        out.append("trainer vs engine logprob |diff| right after each update (mean over steps): " +
                   ", ".join(f"{m} {statistics.mean(v):.2e}" for m, v in lps.items()))
    adapter = next((u["adapter"] for u in rows[0]["updates"].values() if u.get("adapter")), None) if rows else None
    if adapter:
        share = adapter["adapter_bytes"] / adapter["base_bytes"]
        out.append(f"adapter-only sync: LoRA rank {adapter['rank']}, {adapter['adapter_bytes'] / 2**20:.2f} MiB of a "
                   f"{adapter['base_bytes'] / 2**20:.1f} MiB base ({share:.1%}), the base never moved; the engines "
                   "served adapter versions "
                   f"{', '.join(str(r['version']) for r in rows)}, one per step")
    oks = [u["checksum_ok"] for r in rows for u in r["updates"].values()]
    ok = "skipped" if None in oks else "ok" if all(oks) else "MISMATCH"
    out.append(f"bitwise checksum after every sync: {ok}")
    return out


def plot(rows: list[dict], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in rows]
    for m in modes:
        a.plot(steps, [r["updates"][m]["phases"]["total"] * 1e3 for r in rows], marker="o", label=m)
    a.set_xlabel("step")
    a.set_ylabel("update time (ms)")
    a.set_title("weight update time per mode")
    a.legend()
    b.plot(steps, [r["reward"] for r in rows], marker="o", color="tab:green")
    b.set_xlabel("step")
    b.set_ylabel("mean reward")
    b.set_title("GRPO reward (rollouts before the step)")
    for m in modes:  # the RFC's train_rollout_logprob_abs_diff, right after each update (0 drawn at 1e-12)
        diffs = [r["updates"][m]["logprob_abs_diff"] for r in rows]
        c.plot(steps, [max(d, 1e-12) if d is not None else float("nan") for d in diffs], marker="o", label=m)
    c.set_yscale("log")
    c.set_xlabel("step")
    c.set_ylabel("mean |trainer - engine logprob|")
    c.set_title("train/rollout logprob |diff| after each update")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
