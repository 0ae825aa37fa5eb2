"""The runtime's own cost, two ways: on one stage, and per action on K stages.

One stage: one stage with chunks=M vs plain gradient accumulation. Both run the same tiny
GPT over the same M micro-batches, forward and backward, without re-materialization.
torch.distributed.pipelining runs the same one-stage job in its own process for
comparison. The pipe runs three times: as it comes (counting the bytes each micro-batch
keeps for the timeline, a hook on every saved tensor), with ``track_memory=False``, and with
the 1f1b schedule. GPipe's fill-drain keeps all M micro-batches' activations until the
backward, where plain accumulation keeps one: more memory touched every step (thousands of
page faults per step here), which the schedule costs, not the runtime. On one stage 1F1B
runs F, B per micro-batch in plain accumulation's order, so its ratio is what the pipeline
machinery (messages, random streams, memory accounting) adds.

Per action: K SleepLayer stages of F = B = 0.5 ms (sleeps, like kernels, release the GIL),
one sample per micro-batch, step time measured for several M and fitted by least squares
to a line in M. The model fitted: with equal stages, once the pipe is full every device
runs one F and one B per micro-batch back to back, each costing its sleep plus an overhead
c (hand-offs, Python, autograd, waiting for the GIL or a core), so

    pipeline (ours, torch.distributed.pipelining; GPipe or 1F1B):  T(M) = (M + K - 1)(F + B + 2c)
    plain sequential (one thread, micro-batch by micro-batch):    T(M) = M K (F + B + 2c)

and c = (slope - F - B) / 2, or (slope / K - F - B) / 2 for plain. The intercept (fill and
drain, start-up) stays out of c. Every c includes what each sleep overshoots, printed
beside it (``sleep_overshoot_us``): plain's c is that plus the autograd and Python cost of
the layer itself, the floor any runtime pays.

    python benchmarks/overhead.py [--microbatches 8] [--steps 30] [--stages 2 4 8]
    python benchmarks/overhead.py --no-fit        # the one-stage comparison only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

import torch_reference
from gpipe import GPipe, scatter
from gpipe.models import GPTConfig, gpt, gpt_loss, sleep_stages, synthetic_tokens
from host import sleep_overshoot_us

_SCHEDULES = ("gpipe", "1f1b")


def one_stage(args: argparse.Namespace) -> dict[str, object]:
    """The tiny GPT on one stage against plain gradient accumulation; the RESULT fields."""
    m = args.microbatches
    config = GPTConfig()
    torch.manual_seed(0)
    model = gpt(config)
    ids, targets = synthetic_tokens(args.batch, config)

    def plain() -> None:
        for x, t in zip(scatter(ids, m), scatter(targets, m)):
            (gpt_loss(model(x), t) * (x.shape[0] / args.batch)).backward()

    pipe = GPipe(model, [len(model)], chunks=m, checkpoint="never")
    lean = GPipe(model, [len(model)], chunks=m, checkpoint="never", track_memory=False)
    in_order = GPipe(model, [len(model)], chunks=m, checkpoint="never", schedule="1f1b")

    runs = {
        "plain": plain,
        "gpipe": lambda: pipe.train_step(ids, targets, gpt_loss),
        "untracked": lambda: lean.train_step(ids, targets, gpt_loss),
        "1f1b": lambda: in_order.train_step(ids, targets, gpt_loss),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name in runs:  # warm-up
        runs[name]()
    for _ in range(args.steps):  # interleaved, so machine noise hits both alike
        for name, run in runs.items():
            model.zero_grad()
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    plain_ms = statistics.median(times["plain"]) * 1e3
    gpipe_ms = statistics.median(times["gpipe"]) * 1e3
    lean_ms = statistics.median(times["untracked"]) * 1e3
    in_order_ms = statistics.median(times["1f1b"]) * 1e3
    print(f"plain gradient accumulation: {plain_ms:.2f} ms   gpipe, 1 stage: {gpipe_ms:.2f} ms"
          f"   the same with track_memory=False: {lean_ms:.2f} ms"
          f"   1f1b, 1 stage: {in_order_ms:.2f} ms")  # fmt: skip
    fields = {
        "microbatches": m,
        "plain_ms": f"{plain_ms:.2f}",
        "gpipe_ms": f"{gpipe_ms:.2f}",
        "ratio": f"{gpipe_ms / plain_ms:.3f}",
        "untracked_ms": f"{lean_ms:.2f}",
        "ratio_untracked": f"{lean_ms / plain_ms:.3f}",
        "onefoneb_ms": f"{in_order_ms:.2f}",
        "ratio_1f1b": f"{in_order_ms / plain_ms:.3f}",
    }
    if not args.no_torch:
        torch_times = torch_reference.step_times(
            gpt,
            (config,),
            [len(model)],
            schedule="gpipe",
            microbatches=m,
            batch=(ids, targets),
            loss_fn=gpt_loss,
            steps=args.steps,
        )
        torch_ms = statistics.median(torch_times) * 1e3
        print(f"torch.distributed.pipelining, 1 stage: {torch_ms:.2f} ms")
        fields["torch_ms"] = f"{torch_ms:.2f}"
        fields["torch_ratio"] = f"{torch_ms / plain_ms:.3f}"
    return fields


def _overhead(counts: list[int], seconds: list[float], work: float, stages: int = 1) -> float:
    """c from the line fitted to step seconds against M (see the module docstring).

    Args:
        counts: the micro-batch counts M.
        seconds: the median step time at each M.
        work: F + B in seconds.
        stages: how many stages one thread runs in turn per micro-batch (K for plain).
    """
    slope = statistics.linear_regression(counts, seconds).slope
    return (slope / stages - work) / 2


def per_action(args: argparse.Namespace) -> dict[str, object]:
    """The fitted overhead per action at each K: ours, torch's, plain; the RESULT fields."""
    f = b = args.action_ms / 1e3
    counts = args.fit_microbatches
    fields: dict[str, object] = {}
    rows = []
    for k in args.stages:
        runs: dict[str, dict[int, Callable[[], object]]] = {name: {} for name in _SCHEDULES}
        runs["plain"] = {}
        pipes = []
        for m in counts:
            x, target = torch.randn(m, 4, requires_grad=True), torch.randn(m, 4)
            for name in _SCHEDULES:
                pipe = GPipe(
                    sleep_stages(k, args.action_ms, args.action_ms),
                    [1] * k,
                    devices=["cpu"] * k,
                    chunks=m,
                    checkpoint="never",
                    schedule=name,
                )
                pipes.append(pipe)
                runs[name][m] = lambda pipe=pipe, x=x, t=target: pipe.train_step(x, t, F.mse_loss)
            model = sleep_stages(k, args.action_ms, args.action_ms)

            def plain(model: torch.nn.Module = model, x: torch.Tensor = x, t=target) -> None:
                for xi, ti in zip(x.split(1), t.split(1)):
                    (F.mse_loss(model(xi), ti) / len(x)).backward()

            runs["plain"][m] = plain
        times = {(name, m): [] for name in runs for m in counts}
        for name, m in times:  # warm-up
            runs[name][m]()
        # NOTE: rounds over every (run, M), so a burst of machine noise lands on all of them
        # alike instead of on one M's steps, which would tilt the fitted line.
        for _ in range(args.fit_steps):
            for (name, m), seconds in times.items():
                began = time.perf_counter()
                runs[name][m]()
                seconds.append(time.perf_counter() - began)
        for pipe in pipes:
            pipe.close()
        c = {
            name: _overhead(
                counts,
                [statistics.median(times[name, m]) for m in counts],
                f + b,
                k if name == "plain" else 1,
            )
            for name in runs
        }
        if not args.no_torch:
            for name in _SCHEDULES:
                measured = torch_reference.step_times_by_microbatches(
                    sleep_stages,
                    (k, args.action_ms, args.action_ms),
                    [1] * k,
                    schedule=name,
                    batches={m: (torch.randn(m, 4), torch.randn(m, 4)) for m in counts},
                    loss_fn=F.mse_loss,
                    steps=args.fit_steps,
                    timeout=900.0,
                )
                step = [statistics.median(measured[m]) for m in counts]
                c[f"torch_{name}"] = _overhead(counts, step, f + b)
        rows.append((k, c))
        for name, value in c.items():
            fields[f"action_ms_{name.replace('-', '_')}_k{k}"] = f"{value * 1e3:.3f}"

    print(f"overhead per action, ms (fitted over M = {', '.join(map(str, counts))}; "
          f"F = B = {args.action_ms:g} ms)")  # fmt: skip
    names = [*_SCHEDULES, *(f"torch_{n}" for n in _SCHEDULES if not args.no_torch), "plain"]
    print(f"{'K':>3} " + " ".join(f"{name:>12}" for name in names))
    for k, c in rows:
        print(f"{k:>3} " + " ".join(f"{c[name] * 1e3:12.3f}" for name in names))
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--no-fit", action="store_true", help="only the one-stage comparison")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="K to fit at")
    parser.add_argument(
        "--fit-microbatches", type=int, nargs="+", default=[8, 16, 24, 32], help="M to fit over"
    )
    parser.add_argument("--fit-steps", type=int, default=9, help="steps per (K, M) in the fit")
    parser.add_argument("--action-ms", type=float, default=0.5, help="F and B of each stage")
    args = parser.parse_args()
    overshoot = sleep_overshoot_us(args.action_ms / 1e3)
    print(f"this host's time.sleep({args.action_ms:g} ms) overshoots by {overshoot:.0f} us")
    fields = one_stage(args)
    if not args.no_fit:
        fields.update(per_action(args))
    fields["sleep_overshoot_us"] = f"{overshoot:.0f}"
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
