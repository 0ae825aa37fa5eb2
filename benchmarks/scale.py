"""Scale on paper: the tiny GPT's pipeline at K = 8 and 32, predicted from a profile.

No machine here has 32 devices, so the simulator says what one would do. It takes each
layer's forward and backward time measured on this CPU (one thread, ``gpipe.profile``), cuts
the model into K stages of equal time (the exact balancer), charges every message between
stages ``latency + bytes / bandwidth`` (a stated network: 25 GB/s and 5 us unless told
otherwise; a message is one micro-batch's activations, its gradient the same size), and
simulates GPipe and 1F1B. Where this machine can run the pipeline itself (K = 2: one core
per stage), the local runtime's measured step is printed beside its prediction (with no
network: stages in one process hand over in memory), which is how far to trust the rest.

    python benchmarks/scale.py
    python benchmarks/scale.py --bandwidth 100e9 --stages 8 16 32 64
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from gpipe import GPipe, Profile, make_schedule, profile, simulate
from gpipe.analysis import Costs
from gpipe.balance import balance_costs
from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens


def predict(
    measured: Profile, k: int, m: int, schedule: str, latency: float, bandwidth: float
) -> tuple[float, float, list[int]]:
    """Simulated step seconds and bubble of ``schedule`` on K stages, and the balance used."""
    balance = balance_costs(measured.costs("time"), k)
    bounds = [0, *itertools.accumulate(balance)]
    spans = list(itertools.pairwise(bounds))
    forward = [sum(measured.forward[a:b]) for a, b in spans]
    backward = [sum(measured.backward[a:b]) for a, b in spans]
    received = [measured.input_bytes[a] for a, _ in spans]  # a stage's input, its gradient
    costs = Costs(
        forward=forward,
        backward=backward,
        latency=latency,
        bandwidth=bandwidth,
        gradient_bytes=received,
    )
    timeline = simulate(make_schedule(schedule, k, m), costs)
    return timeline.makespan, timeline.bubble, balance


def local_step(config: GPTConfig, batch: int, k: int, m: int, schedule: str, steps: int) -> float:
    """Median seconds of the local runtime's train_step on this machine (K threads)."""
    torch.manual_seed(0)
    model = gpt(config)
    layers = len(model)
    measured = profile(model, synthetic_tokens(batch // m, config)[0], repeats=3)
    pipe = GPipe(
        model,
        balance_costs(measured.costs("time"), k),
        devices=["cpu"] * k,
        chunks=m,
        checkpoint="never",
        schedule=schedule,
    )
    del layers
    ids, targets = synthetic_tokens(batch, config)
    times = []
    for step in range(steps + 1):
        began = time.perf_counter()
        pipe.train_step(ids, targets, gpt_loss)
        if step:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--layers", type=int, default=32, help="transformer blocks")
    parser.add_argument("--bandwidth", type=float, default=25e9, help="bytes per second")
    parser.add_argument("--latency", type=float, default=5e-6, help="seconds per message")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = GPTConfig(layers=args.layers, dropout=0.0)
    model = gpt(config)
    print(
        f"tiny GPT, {args.layers} blocks ({len(model)} layers, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters), batch {args.batch}; "
        f"network {args.bandwidth / 1e9:g} GB/s + {args.latency * 1e6:g} us per message"
    )
    print(
        f"{'K':>3} {'M':>4} {'schedule':>8} {'predicted ms':>13} {'bubble':>7} {'measured ms':>12}"
    )
    results = []
    for m in args.microbatches:
        ids = synthetic_tokens(args.batch // m, config)[0]
        measured = profile(model, ids, repeats=3)
        for k, schedule in itertools.product(args.stages, ("gpipe", "1f1b")):
            if k > len(model):
                continue
            step, bubble, _ = predict(measured, k, m, schedule, args.latency, args.bandwidth)
            local = None
            if k <= (torch.get_num_interop_threads() and 2) and m <= 32:
                local = local_step(config, args.batch, k, m, schedule, args.steps)
            shown = f"{local * 1e3:12.1f}" if local else f"{'-':>12}"
            print(f"{k:>3} {m:>4} {schedule:>8} {step * 1e3:13.1f} {bubble:7.3f} {shown}")
            results.append((k, m, schedule, step, bubble, local))
    for k, m, schedule, step, bubble, local in results:
        extra = f" measured_ms={local * 1e3:.1f} error={step / local - 1:+.3f}" if local else ""
        print(
            f"RESULT stages={k} microbatches={m} schedule={schedule} "
            f"predicted_ms={step * 1e3:.1f} bubble={bubble:.4f}{extra}"
        )


if __name__ == "__main__":
    main()
