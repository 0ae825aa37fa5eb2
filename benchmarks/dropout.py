"""Dropout in every stage: step time with and without it, and what a random stream costs.

Each of K stages is a SleepLayer (forward F ms, backward B ms, releasing the GIL) followed
by Dropout(p) or by Identity, as two layers ("dropout layers") or as one ("dropout inside a
layer"). Since every (layer, micro-batch) draws from its own stream, stages that draw
overlap like any others, so the step times should match (the target is <= 1.1x): a lone
dropout is cheaper to run holding the shared CPU generator for its few microseconds, the
slow layer is routed (see gpipe.randomness.streams), and neither keeps the generator across
a stage's forward. "serialized" reproduces the old design, in which a stage that drew random
numbers held its device's generator, under a lock, for its whole forward: all "cpu" stages
share one generator, so their forwards ran one at a time. The ideal is the simulator's
makespan, (M + K - 1)(F + B) for GPipe; torch.distributed.pipelining runs the same dropout
stages, one process per stage.

Then what the streams cost: per op run under the routing dispatch mode (layers that draw on
a generator several workers share: the CPU's, in a local pipe with several "cpu" stages),
per layer call seeding a generator the worker owns (one GPU per stage, a one-device pipe,
a one-stage process), per stage forward for watching the default generators, and on the
tiny GPT of gpipe.models (whose blocks all contain dropout) over one micro-batch's forward
and backward, each way a layer can draw. CPU time of this thread, medians, so a busy
machine skews them less.

    python benchmarks/dropout.py [--stages 4] [--microbatches 8] [--steps 7] [--no-torch]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import torch_reference
from gpipe import GPipe
from gpipe.analysis import Costs, simulate
from gpipe.models import GPTConfig, SleepLayer, gpt, gpt_loss, synthetic_tokens
from gpipe.randomness import layer_stream
from gpipe.randomness.generators import WorkerGenerators
from gpipe.schedule import make_schedule

_GENERATOR_LOCK = threading.Lock()


class Serialized(nn.Module):
    """The old design's cost: the whole stage forward holds the one CPU generator's lock."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _GENERATOR_LOCK:
            return self.stage(x)


def stages(k: int, f: float, b: float, p: float | None, how: str = "layers") -> nn.Sequential:
    """K stages of SleepLayer + Dropout(p) (Identity if p is None): two layers each
    ("layers"), one layer each ("one layer"), or one layer under the old lock ("serialized").
    """
    blocks = [
        nn.Sequential(SleepLayer(f, b), nn.Dropout(p) if p else nn.Identity()) for _ in range(k)
    ]
    if how == "serialized":
        return nn.Sequential(*[Serialized(block) for block in blocks])
    if how == "one layer":
        return nn.Sequential(*blocks)
    return nn.Sequential(*[layer for block in blocks for layer in block])


def step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median ms per train_step of each variant, steps interleaved so noise hits all alike."""
    k, m, f, b = args.stages, args.microbatches, args.forward_ms, args.backward_ms
    variants = {
        "no dropout": stages(k, f, b, None),
        "dropout": stages(k, f, b, args.p),
        "dropout in layer": stages(k, f, b, args.p, how="one layer"),
        "serialized": stages(k, f, b, args.p, how="serialized"),
    }
    pipes = {
        name: GPipe(model, [len(model) // k] * k, devices=["cpu"] * k, chunks=m, checkpoint="never")
        for name, model in variants.items()
    }
    x, target = torch.randn(m, 4, requires_grad=True), torch.randn(m, 4)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for step in range(args.steps + 1):  # the first step warms up
        for name, pipe in pipes.items():
            began = time.perf_counter()
            pipe.train_step(x, target, F.mse_loss)
            if step:
                times[name].append(time.perf_counter() - began)
    streams = pipes["dropout"]._stages.streams
    print("how the layers draw: dropout as a layer of its own:", streams.kind(1, True),
          "| dropout inside the stage's one layer:",
          pipes["dropout in layer"]._stages.streams.kind(0, True))  # fmt: skip
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def torch_ms(args: argparse.Namespace) -> float:
    """Median ms per step of torch.distributed.pipelining on the same dropout stages."""
    k, m = args.stages, args.microbatches
    return 1e3 * statistics.median(
        torch_reference.step_times(
            stages,
            (k, args.forward_ms, args.backward_ms, args.p),
            [2] * k,
            schedule="gpipe",
            microbatches=m,
            batch=(torch.randn(m, 4), torch.randn(m, 4)),
            loss_fn=F.mse_loss,
            steps=args.steps,
        )
    )


def cpu_us(run: Callable[[], Any], repeats: int = 15, number: int = 200) -> float:
    """Median CPU µs of this thread per call of ``run``, on one intra-op thread.

    NOTE: with more, this thread's CPU time would include OpenMP's spin-waiting.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = []
        for _ in range(repeats):
            began = time.thread_time()
            for _ in range(number):
                run()
            samples.append((time.thread_time() - began) / number * 1e6)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(samples)


def stream_costs() -> dict[str, float]:
    """What a random stream costs: per routed op, per seeded layer call, per stage watch."""
    x = torch.randn(4, 4)
    dropout = nn.Dropout(0.1)

    def adds() -> None:
        for _ in range(10):
            x.add(1)

    def routed(run: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with layer_stream(1, 0, 0):
                return run()

        return call

    owned = WorkerGenerators.of(torch.device("cpu"), [torch.device("cpu")])
    shared = WorkerGenerators.of(torch.device("cpu"), [torch.device("cpu")] * 2)

    def seeded_dropout() -> None:
        with owned.seeded_own(1):
            dropout(x)

    empty = cpu_us(routed(lambda: None))
    costs = {
        "route_us_per_op": (cpu_us(routed(adds)) - empty - cpu_us(adds)) / 10,
        "dropout_us": cpu_us(lambda: dropout(x)),
        "routed_dropout_us": cpu_us(routed(lambda: dropout(x))),
        "seeded_dropout_us": cpu_us(seeded_dropout),
        "watch_us": cpu_us(shared.read),
    }
    return costs


def gpt_costs() -> dict[str, float]:
    """CPU ms of one micro-batch's forward and backward of the tiny GPT, by how it draws."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = gpt(config)
    ids, targets = synthetic_tokens(8, config)
    owned = WorkerGenerators.of(torch.device("cpu"), [torch.device("cpu")])

    def run(scope: Callable[[int], Any] | None) -> None:
        h = ids
        for i, layer in enumerate(model):
            if scope is None:
                h = layer(h)
            else:
                with scope(i):
                    h = layer(h)
        gpt_loss(h, targets).backward()

    shared = WorkerGenerators.of(torch.device("cpu"), [torch.device("cpu")] * 2)
    ways = {
        "plain": lambda: run(None),
        "seeded": lambda: run(lambda i: owned.seeded_own(i)),
        "held": lambda: run(lambda i: shared.seeded_shared(i)),
        "routed": lambda: run(lambda i: layer_stream(1, i, 0)),
    }
    return {name: cpu_us(way, repeats=9, number=5) / 1e3 for name, way in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument("--p", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    args = parser.parse_args()
    k, m, f, b = args.stages, args.microbatches, args.forward_ms, args.backward_ms

    ideal = simulate(make_schedule("gpipe", k, m), Costs(forward=f, backward=b)).makespan
    measured = step_times(args)
    print(f"K={k} M={m} SleepLayer F={f:g} B={b:g} ms per stage, Dropout({args.p:g}), GPipe, "
          f"no re-materialization; median of {args.steps} steps")  # fmt: skip
    print(f"{'variant':>32} {'ms/step':>9} {'x no dropout':>13} {'x ideal':>8}")
    rows = [
        ("ideal (simulator)", ideal),
        ("gpipe, no dropout", measured["no dropout"]),
        ("gpipe, dropout layers", measured["dropout"]),
        ("gpipe, dropout inside a layer", measured["dropout in layer"]),
        ("old design: stages serialized", measured["serialized"]),
    ]
    reference = None if args.no_torch else torch_ms(args)
    if reference is not None:
        rows.append(("torch pipelining, dropout", reference))
    for name, ms in rows:
        print(f"{name:>32} {ms:9.1f} {ms / measured['no dropout']:13.3f} {ms / ideal:8.3f}")

    costs = stream_costs()
    print()
    print(f"routing mode: {costs['route_us_per_op']:.1f} us of CPU per op run under it "
          f"(x.add(1) on 4x4); Dropout(0.1) on 4x4: {costs['dropout_us']:.1f} us plain, "
          f"{costs['routed_dropout_us']:.1f} us routed, {costs['seeded_dropout_us']:.1f} us on "
          f"an owned generator; watching the shared CPU generator: {costs['watch_us']:.1f} us "
          "per stage forward")  # fmt: skip
    gpt_ms = gpt_costs()
    print(f"tiny GPT, one micro-batch of 8 forward + backward, CPU ms: {gpt_ms['plain']:.2f} "
          f"plain, {gpt_ms['seeded']:.2f} seeded (owned generator), {gpt_ms['held']:.2f} held "
          f"(shared generator, what the pipe picks for its blocks), {gpt_ms['routed']:.2f} "
          "routed (every block draws, so every forward op would be routed)")  # fmt: skip

    fields: dict[str, object] = {
        "stages": k,
        "microbatches": m,
        "ideal_ms": f"{ideal:.1f}",
        "no_dropout_ms": f"{measured['no dropout']:.1f}",
        "dropout_ms": f"{measured['dropout']:.1f}",
        "ratio": f"{measured['dropout'] / measured['no dropout']:.3f}",
        "dropout_in_layer_ms": f"{measured['dropout in layer']:.1f}",
        "ratio_in_layer": f"{measured['dropout in layer'] / measured['no dropout']:.3f}",
        "serialized_ms": f"{measured['serialized']:.1f}",
        "serialized_ratio": f"{measured['serialized'] / measured['no dropout']:.3f}",
    }
    if reference is not None:
        fields["torch_dropout_ms"] = f"{reference:.1f}"
    fields |= {
        "route_us_per_op": f"{costs['route_us_per_op']:.1f}",
        "watch_us": f"{costs['watch_us']:.1f}",
        "gpt_plain_ms": f"{gpt_ms['plain']:.2f}",
        "gpt_seeded_ratio": f"{gpt_ms['seeded'] / gpt_ms['plain']:.3f}",
        "gpt_held_ratio": f"{gpt_ms['held'] / gpt_ms['plain']:.3f}",
        "gpt_routed_ratio": f"{gpt_ms['routed'] / gpt_ms['plain']:.3f}",
    }
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
