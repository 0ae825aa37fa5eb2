"""What overlapping messages with compute is worth: the same pipeline with it on and off.

K processes, one stage each, whose work is a sleep (forward F ms, backward B ms) on a large
activation, so each micro-batch sends ``--megabytes`` MiB forward and as much back: a
workload whose messages cost a fair share of its compute. With overlap (the default) each
rank posts its receives ahead and completes its sends in the background; without, a send
waits until its message is received and a message is received only when the action that
needs it asks (``DistributedGPipe(overlap=False)``). GPipe's fill-drain schedule, whose
ranks take each peer's messages in the order sent, as the synchronous mode needs.

    python benchmarks/overlap.py
    python benchmarks/overlap.py --stages 4 --megabytes 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.nn import functional as F

import gpipe.distributed as gd
from gpipe.models import sleep_stages


def step_times(k: int, m: int, f: float, b: float, rows: int, steps: int) -> dict[str, Any]:
    rank, _ = gd.init()
    out: dict[str, Any] = {}
    x, y = torch.randn(m * rows, 1024), torch.randn(m * rows, 1024)
    for overlap in (True, False):
        pipe = gd.DistributedGPipe(
            sleep_stages(k, f, b), [1] * k, chunks=m, checkpoint="never", overlap=overlap
        )
        times = []
        for step in range(steps + 1):
            began = time.perf_counter()
            pipe.train_step(x, y, F.mse_loss)
            if step:
                times.append(time.perf_counter() - began)
        timeline = pipe.timeline
        moved = [t.end - t.start for t in timeline.transfers]
        out["on" if overlap else "off"] = (statistics.median(times), statistics.median(moved))
        out["link"] = pipe._link
        pipe.close()
    return out if rank == 0 else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--megabytes", type=float, default=8.0, help="MiB per message")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = max(1, int(args.megabytes * 2**20 / 4 / 1024))
    k, m, f, b = args.stages, args.microbatches, args.forward_ms, args.backward_ms
    result = gd.spawn(step_times, k, k, m, f, b, rows, args.steps, threads=1)[0]
    on, on_move = result["on"]
    off, off_move = result["off"]
    latency, bandwidth = result["link"]
    nbytes = rows * 1024 * 4
    transfer = latency + nbytes / bandwidth
    ideal = (m + k - 1) * (f + b) / 1e3
    print(
        f"K={k} M={m} F={f} B={b} ms, {nbytes / 2**20:.1f} MiB per message; link: "
        f"{latency * 1e6:.0f} us + {bandwidth / 1e9:.2f} GB/s -> {transfer * 1e3:.2f} ms per "
        f"message = {transfer / (f / 1e3):.0%} of a forward"
    )
    print(f"compute-only ideal (M+K-1)(F+B): {ideal * 1e3:.1f} ms")
    for name, seconds, moving in (("on ", on, on_move), ("off", off, off_move)):
        print(
            f"overlap {name}: {seconds * 1e3:8.1f} ms per step  "
            f"(median message in flight {moving * 1e3:.2f} ms)"
        )
    print(
        f"RESULT stages={k} microbatches={m} message_mib={nbytes / 2**20:.1f} "
        f"transfer_share={transfer / (f / 1e3):.3f} ideal_ms={ideal * 1e3:.1f} "
        f"overlap_ms={on * 1e3:.1f} sync_ms={off * 1e3:.1f} speedup={off / on:.3f}"
    )


if __name__ == "__main__":
    main()
