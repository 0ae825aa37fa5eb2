"""Stages of known latency: measured step time vs the ideal, the simulator, and torch.

Each stage is a SleepLayer (forward F ms, backward B ms), so the ideal GPipe step is
(M + K - 1)(F + B) and any excess is the runtime's own overhead.

    python benchmarks/latency.py                      # K=4, M=16, F=10, B=20 and the grid
    python benchmarks/latency.py --stages 4 --microbatches 16 --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

import torch_reference
from gpipe import GPipe
from gpipe.models import sleep_stages


def measure(k: int, m: int, f_ms: float, b_ms: float, schedule: str, steps: int) -> list[float]:
    pipe = GPipe(
        sleep_stages(k, f_ms, b_ms), [1] * k, chunks=m, checkpoint="never", schedule=schedule
    )
    x, target = torch.randn(m, 4), torch.randn(m, 4)
    pipe.train_step(x, target, F.mse_loss)  # warm-up
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        pipe.train_step(x, target, F.mse_loss)
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    args = parser.parse_args()
    f, b = args.forward_ms, args.backward_ms

    print(f"{'K':>3} {'M':>3} {'ideal ms':>9} {'gpipe ms':>9} {'eff':>6}")
    headline: dict[str, float] = {}
    for k in args.stages:
        for m in args.microbatches:
            ideal = (m + k - 1) * (f + b) / 1000
            measured = statistics.median(measure(k, m, f, b, "gpipe", args.steps))
            print(f"{k:>3} {m:>3} {ideal * 1e3:9.1f} {measured * 1e3:9.1f} {ideal / measured:6.3f}")
            if (k, m) == (4, 16) or not headline:
                headline = {"k": k, "m": m, "ideal": ideal, "measured": measured}

    k, m = int(headline["k"]), int(headline["m"])
    fields = {
        "stages": k,
        "microbatches": m,
        "ideal_ms": f"{headline['ideal'] * 1e3:.1f}",
        "gpipe_ms": f"{headline['measured'] * 1e3:.1f}",
        "efficiency": f"{headline['ideal'] / headline['measured']:.3f}",
    }
    if not args.no_torch:
        batch = (torch.randn(m, 4), torch.randn(m, 4))
        torch_times = torch_reference.step_times(
            sleep_stages,
            (k, f, b),
            [1] * k,
            schedule="gpipe",
            microbatches=m,
            batch=batch,
            loss_fn=F.mse_loss,
            steps=args.steps,
        )
        torch_ms = statistics.median(torch_times) * 1e3
        print(
            f"torch.distributed.pipelining ScheduleGPipe K={k} M={m}: {torch_ms:.1f} ms, "
            f"efficiency {headline['ideal'] * 1e3 / torch_ms:.3f}"
        )
        fields["torch_ms"] = f"{torch_ms:.1f}"
        fields["torch_efficiency"] = f"{headline['ideal'] * 1e3 / torch_ms:.3f}"
        fields["speedup_vs_torch"] = f"{torch_ms / (headline['measured'] * 1e3):.3f}"
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
