"""The latency of one decoding step's all-reduce between two CPU processes: gloo's own all-reduce against
the exchange pipeline/engine/parallel/group.py runs (each rank's tensor sent to the other, the parts
summed in rank order), alternating, median of 5 blocks of 200.

    .venv/bin/python -m bench.research.allreduce --width 896 --rounds 2
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from pipeline.engine.parallel.group import RankGroup, free_address, open_rendezvous


def blocks(group: RankGroup, kind: str, width: int) -> list[float]:
    """ms per all-reduce of a [1, width] fp32 tensor, for each of 5 blocks of 200 (after 50 untimed)."""
    t = torch.ones(1, width)

    def once():
        t.fill_(1.0)
        group.pg.allreduce([t]).wait() if kind == "gloo" else group.all_reduce(t)
    for _ in range(50):
        once()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            once()
        out.append((time.perf_counter() - t0) / 200 * 1e3)
    return out


def _peer(address: str, kind: str, width: int) -> None:
    torch.set_num_threads(1)
    blocks(RankGroup.join(address, 1, 2, "cpu", 60), kind, width)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=896, help="the hidden size (Qwen2.5-0.5B: 896)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two kinds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for _ in range(args.rounds):
        for kind in ("gloo", "exchange"):
            address = free_address("127.0.0.1")
            peer = multiprocessing.get_context("spawn").Process(target=_peer, args=(address, kind, args.width))
            peer.start()
            group = RankGroup.join(address, 0, 2, "cpu", 60, store=open_rendezvous(address, 2, 60))
            ms = blocks(group, kind, args.width)
            peer.join()
            group.close()
            print(f"{kind}: {statistics.median(ms):.3f} ms per all-reduce [{min(ms):.3f}, {max(ms):.3f}]")


if __name__ == "__main__":
    main()
