"""Resident memory over a long healthy run: does RSS level off, and if not, per step or per pipe?

Two ranks train a tiny pipe (4 x Linear(8, 8), 1F1B, 2 micro-batches); a new pipe replaces the
old one (closed first) every ``--pipe-every`` steps. Each rank reads its VmRSS every
``--sample-every`` steps; after a warm-up of ``--warmup`` of the steps, the least-squares
slope (bytes per step) and the growth from the first to the last sample are reported. To
tell steps from pipes apart: ``--pipe-every 0`` keeps one pipe (growth per step);
``--no-steps`` only makes and closes pipes (growth per pipe, reported per ``--pipe-every``
steps so the figures compare). ``--tracemalloc`` adds the growth of Python's own
allocations over the same window, and their largest sources. The launcher's own process
hosts the c10d store (torch's elastic agent): its RSS, sampled each second, is the store's.

    python benchmarks/soak.py                              # 50,000 steps, a new pipe every 10
    python benchmarks/soak.py --steps 5000                 # a quick look
    python benchmarks/soak.py --pipe-every 0               # one pipe: per-step growth
    python benchmarks/soak.py --no-steps --tracemalloc     # only new pipes
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
import tracemalloc
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import gpipe.distributed as gd


def rss() -> int:
    """This process's resident set, in bytes (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per step through (step, bytes) points; 0 for fewer than two."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def make_pipe() -> gd.DistributedGPipe:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    return gd.DistributedGPipe(model, [2, 2], chunks=2, schedule="1f1b", timeout=30)


def soak(
    steps: int,
    pipe_every: int,
    train: bool,
    sample_every: int,
    warmup: float,
    trace: bool,
) -> dict[str, Any]:
    """On every rank: its RSS samples and the slope and growth after the warm-up."""
    gd.init()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = make_pipe()
    if trace:
        tracemalloc.start(8)
    samples: list[tuple[int, int]] = []
    first_snapshot = None
    start = int(steps * warmup)
    began = time.monotonic()
    for step in range(1, steps + 1):
        if pipe_every and step % pipe_every == 0:
            pipe.close()
            del pipe
            pipe = make_pipe()
        if train:
            pipe.train_step(x, y, F.mse_loss)
        if step % sample_every == 0:
            gc.collect()
            samples.append((step, rss()))
            if trace and first_snapshot is None and step >= start:
                first_snapshot = tracemalloc.take_snapshot()
    pipe.close()
    after = [(s, b) for s, b in samples if s >= start]
    out: dict[str, Any] = {
        "samples": samples,
        "bytes_per_step": slope(after),
        "growth": after[-1][1] - after[0][1] if after else 0,
        "seconds": time.monotonic() - began,
    }
    if trace and first_snapshot is not None:
        stats = tracemalloc.take_snapshot().compare_to(first_snapshot, "traceback")
        out["python_growth"] = sum(s.size_diff for s in stats)
        out["python_top"] = [
            f"{s.size_diff:+d} B {s.count_diff:+d} blocks at "
            + " <- ".join(
                f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in list(s.traceback)[::-1][:4]
            )
            for s in sorted(stats, key=lambda s: -s.size_diff)[:5]
        ]
    return out


def run(args: argparse.Namespace) -> None:
    """Samples per rank, each rank's slope and growth, then one RESULT line."""
    train = not args.no_steps
    if not train and not args.pipe_every:
        raise ValueError("--no-steps needs --pipe-every > 0: there would be nothing to run")
    # NOTE: this process is the launcher's agent, which hosts the c10d store: its RSS is
    # the store's (sampled by time, as the ranks' steps are not visible here)
    host: list[tuple[float, int]] = []
    done = threading.Event()

    def sample_host() -> None:
        began = time.monotonic()
        while not done.wait(1.0):
            host.append((time.monotonic() - began, rss()))

    sampler = threading.Thread(target=sample_host, daemon=True)
    sampler.start()
    try:
        results = gd.spawn(
            soak,
            2,
            args.steps,
            args.pipe_every,
            train,
            args.sample_every,
            args.warmup,
            args.tracemalloc,
            threads=1,
        )
    finally:
        done.set()
        sampler.join()
    what = "steps" if train else "no steps (pipes only)"
    pipes = f"a new pipe every {args.pipe_every} steps" if args.pipe_every else "one pipe"
    print(f"2 ranks, 4 x Linear(8, 8), 1f1b, chunks=2; {args.steps} iterations, {what}, {pipes}")
    print(f"warm-up {args.warmup:.0%}; RSS sampled every {args.sample_every} iterations")
    for rank in (0, 1):
        r = results[rank]
        shown = " ".join(
            f"{b / 2**20:.2f}" for _, b in r["samples"][:: max(1, len(r["samples"]) // 10)]
        )
        print(f"rank {rank}: RSS MiB (every ~10th sample) {shown}")
        print(
            f"rank {rank}: {r['bytes_per_step']:.1f} B/iteration after warm-up, growth "
            f"{r['growth'] / 2**20:.3f} MiB, {r['seconds']:.0f} s"
        )
        if "python_growth" in r:
            print(f"rank {rank}: tracemalloc growth after warm-up {r['python_growth']} B")
            for line in r["python_top"]:
                print(f"    {line}")
    seconds = max(r["seconds"] for r in results.values())
    after = [(t, b) for t, b in host if t >= host[-1][0] - seconds * (1 - args.warmup)]
    per_second = slope([(int(t * 1000), b) for t, b in after]) * 1000
    store_per_step = per_second * seconds / args.steps
    store_growth = after[-1][1] - after[0][1] if after else 0
    print(
        f"store host (the launcher): {store_per_step:.1f} B/iteration after warm-up, growth "
        f"{store_growth / 2**20:.3f} MiB"
    )
    print(
        f"RESULT steps={args.steps} pipe_every={args.pipe_every} train={int(train)} "
        f"rank0_bytes_per_step={results[0]['bytes_per_step']:.1f} "
        f"rank1_bytes_per_step={results[1]['bytes_per_step']:.1f} "
        f"rank0_growth_mib={results[0]['growth'] / 2**20:.3f} "
        f"rank1_growth_mib={results[1]['growth'] / 2**20:.3f} "
        f"store_bytes_per_step={store_per_step:.1f} store_growth_mib={store_growth / 2**20:.3f}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=50000, help="iterations")
    parser.add_argument(
        "--pipe-every",
        type=int,
        default=10,
        help="a new pipe every N iterations (0: one pipe)",
    )
    parser.add_argument("--no-steps", action="store_true", help="only make and close pipes")
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the iterations")
    parser.add_argument("--tracemalloc", action="store_true", help="Python's allocations too")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args())
