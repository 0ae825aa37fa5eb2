"""Stages of known latency: measured step time vs the simulator, the ideal, and torch.

Each model stage is a SleepLayer: forward F ms, input gradient B ms, weight gradient W ms.
A schedule without W actions pays B + W in its backward; zero-bubble (zb-h1) pays them
apart. With zero overhead the runtime would take exactly what the simulator predicts for
the schedule under these costs, so the simulator's makespan is each schedule's ideal, and
``error = measured / predicted - 1`` is everything lost on the way. Two more predictions
split that loss: "calibrated" feeds the simulator F, B and W measured on one SleepLayer alone
(what the layer itself costs beyond its nominal sleep: timer overshoot, autograd), so its
error is the pipeline's own overhead, as a user who profiles and then simulates would see
it; "own" feeds it the step's own measured action durations (hand-offs and waits only).
For GPipe with equal stages the ideal is (M + K - 1)(F + B + W).

Interleaved runs K·v SleepLayers (v model stages per device, each costing F, B, W), so it
does v times the work of the others. ZB-H1 splits the same total backward in two: by
default B = W = B/2 (10 + 10 ms against the others' 20 ms), so the split matters.

    python benchmarks/latency.py           # the GPipe grid, then every schedule at K=4, M=16
    python benchmarks/latency.py --quick   # only the schedules, fewer steps, no torch
    python benchmarks/latency.py --distributed   # one process per stage, gpipe and 1f1b
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

import torch_reference
from gpipe import GPipe
from gpipe.analysis import Costs, costs_from_timeline, simulate
from gpipe.models import SleepLayer, sleep_stages
from gpipe.schedule import make_schedule
from host import sleep_overshoot_us


@dataclass(frozen=True)
class Case:
    """One schedule on K devices, M micro-batches, and per-model-stage costs in ms."""

    schedule: str
    k: int
    m: int
    f: float
    b: float
    w: float = 0.0
    v: int = 1

    @property
    def layers(self) -> int:
        return self.k * self.v

    def predicted_ms(self) -> float:
        """The simulator's makespan: this schedule's step with zero runtime overhead."""
        schedule = make_schedule(self.schedule, self.k, self.m, virtual_stages=self.v)
        return simulate(schedule, Costs(forward=self.f, backward=self.b, weight=self.w)).makespan

    def gpipe_ideal_ms(self) -> float:
        return (self.m + self.k - 1) * (self.f + self.b + self.w)

    def calibrated_ms(self, repeats: int = 7) -> float:
        """The simulator's makespan with costs measured on one SleepLayer alone.

        This is how a user predicts a pipeline (profile the stages, then simulate): the
        layer's real F, B and W include what its sleeps overshoot and its autograd overhead,
        which nominal costs leave out; the pipeline's own hand-offs and waits stay out.
        """
        layer = SleepLayer(self.f, self.b, self.w)
        forward, backward, weight, whole = [], [], [], []
        for _ in range(repeats):
            x = torch.randn(1, 4, requires_grad=True)
            began = time.perf_counter()
            y = layer(x)
            forward.append(time.perf_counter() - began)
            began = time.perf_counter()
            torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
            backward.append(time.perf_counter() - began)
            began = time.perf_counter()
            torch.autograd.backward(y, torch.ones_like(y), inputs=[layer.weight])
            weight.append(time.perf_counter() - began)
            y = layer(x)
            began = time.perf_counter()
            y.backward(torch.ones_like(y))
            whole.append(time.perf_counter() - began)
        f = statistics.median(forward) * 1e3
        schedule = make_schedule(self.schedule, self.k, self.m, virtual_stages=self.v)
        if schedule.split_backward:
            b, w = statistics.median(backward) * 1e3, statistics.median(weight) * 1e3
        else:
            b, w = statistics.median(whole) * 1e3, 0.0
        return simulate(schedule, Costs(forward=f, backward=b, weight=w)).makespan


def measure(case: Case, steps: int) -> tuple[list[float], float]:
    """Seconds per ``train_step`` after one warm-up step, and the prediction in ms from the
    last step's own action durations (so its error is the runtime's scheduling overhead,
    without what each SleepLayer overshoots its nominal sleep)."""
    pipe = GPipe(
        sleep_stages(case.layers, case.f, case.b, case.w),
        [1] * case.layers,
        devices=["cpu"] * case.k,
        chunks=case.m,
        checkpoint="never",
        schedule=case.schedule,
        virtual_stages=case.v,
    )
    # NOTE: the input requires grad so stage 0 runs B and W apart like every other stage, as
    # the cost model says; without it SleepLayer moves stage 0's B onto its W.
    x, target = torch.randn(case.m, 4, requires_grad=True), torch.randn(case.m, 4)
    pipe.train_step(x, target, F.mse_loss)  # warm-up
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        pipe.train_step(x, target, F.mse_loss)
        times.append(time.perf_counter() - began)
    schedule = make_schedule(case.schedule, case.k, case.m, virtual_stages=case.v)
    own = simulate(schedule, costs_from_timeline(pipe.timeline, case.layers)).makespan
    return times, own * 1e3


def torch_ms(case: Case, steps: int) -> float:
    """Median ms per step of torch.distributed.pipelining on the same stages."""
    times = torch_reference.step_times(
        sleep_stages,
        (case.k, case.f, case.b + case.w),
        [1] * case.k,
        schedule=case.schedule,
        microbatches=case.m,
        batch=(torch.randn(case.m, 4), torch.randn(case.m, 4)),
        loss_fn=F.mse_loss,
        steps=steps,
    )
    return statistics.median(times) * 1e3


def gpipe_grid(args: argparse.Namespace) -> None:
    f, b = args.forward_ms, args.backward_ms
    print(f"{'K':>3} {'M':>3} {'ideal ms':>9} {'gpipe ms':>9} {'eff':>6} {'error':>7}")
    for k in args.stages:
        for m in args.microbatches:
            ideal = (m + k - 1) * (f + b)
            times, _ = measure(Case("gpipe", k, m, f, b), args.steps)
            measured = statistics.median(times) * 1e3
            print(f"{k:>3} {m:>3} {ideal:9.1f} {measured:9.1f} {ideal / measured:6.3f} "
                  f"{measured / ideal - 1:+7.2%}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--backward-ms", type=float, default=20.0)
    parser.add_argument(
        "--zb-weight-ms",
        type=float,
        default=None,
        help="the part of the backward that zb-h1 runs as W (default: half of it)",
    )
    parser.add_argument("--virtual-stages", type=int, default=2, help="v for interleaved")
    parser.add_argument("--headline", type=int, nargs=2, default=[4, 16], metavar=("K", "M"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--quick", action="store_true", help="no grid, no torch, 3 steps")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="one process per stage (benchmarks/latency_distributed.py): gpipe and 1f1b",
    )
    args = parser.parse_args()
    if args.distributed:
        import latency_distributed

        args.rounds = 3  # ours and torch's in turns (see latency_distributed.both)
        if args.quick:
            args.no_torch, args.steps, args.stages, args.microbatches = True, 3, [4], [16]
            args.rounds = 1
        latency_distributed.run(args)
        return
    if args.quick:
        args.no_torch, args.steps = True, 3
    f, b = args.forward_ms, args.backward_ms
    zb_w = b / 2 if args.zb_weight_ms is None else args.zb_weight_ms
    overshoot = sleep_overshoot_us(f / 1e3, repeats=30)
    print(f"this host's time.sleep({f:g} ms) overshoots by {overshoot:.0f} us (median of 30); "
          "every sleep pays it, so absolute figures move with it and ratios hold")  # fmt: skip

    if not args.quick:
        gpipe_grid(args)
        print()

    k, m = args.headline
    cases = [
        Case("1f1b", k, m, f, b),
        Case("interleaved", k, m, f, b, v=args.virtual_stages),
        Case("zb-h1", k, m, f, b - zb_w, zb_w),
        Case("gpipe", k, m, f, b),  # last: the final RESULT line is the headline
    ]
    v = args.virtual_stages
    print(f"every schedule at K={k} M={m}, per model stage F={f:g} B={b:g} W=0 ms; "
          f"zb-h1 F={f:g} B={b - zb_w:g} W={zb_w:g} ms (the same work, split); "
          f"interleaved v={v} runs {v}x the layers")  # fmt: skip
    header = (
        f"{'schedule':>15} {'F/B/W ms':>10} {'measured':>9} {'predicted':>9} {'error':>7} "
        f"{'eff':>6} {'calibrated':>10} {'error':>7} {'own pred':>9} {'error':>7} "
        f"{'gpipe ideal':>11} {'torch':>8}"
    )
    print(header)
    results = []
    for case in cases:
        times, own = measure(case, args.steps)
        measured = statistics.median(times) * 1e3
        predicted = case.predicted_ms()
        fields: dict[str, object] = {
            "schedule": case.schedule,
            "stages": case.k,
            "microbatches": case.m,
            "measured_ms": f"{measured:.1f}",
            "predicted_ms": f"{predicted:.1f}",
            "error": f"{measured / predicted - 1:.4f}",
            "efficiency": f"{predicted / measured:.3f}",
            "sleep_overshoot_us": f"{overshoot:.0f}",
        }
        calibrated = case.calibrated_ms()
        fields["predicted_calibrated_ms"] = f"{calibrated:.1f}"
        fields["error_calibrated"] = f"{measured / calibrated - 1:.4f}"
        fields["predicted_own_ms"] = f"{own:.1f}"
        fields["error_own"] = f"{measured / own - 1:.4f}"
        if case.v > 1:
            fields["virtual_stages"] = case.v
        reference = None
        if not args.no_torch and case.schedule in torch_reference.TORCH_SCHEDULES:
            reference = torch_ms(case, args.steps)
            fields["torch_ms"] = f"{reference:.1f}"
            fields["speedup_vs_torch"] = f"{reference / measured:.3f}"
        if case.schedule == "gpipe":  # the keys this benchmark printed before, kept
            fields["ideal_ms"] = f"{case.gpipe_ideal_ms():.1f}"
            fields["gpipe_ms"] = f"{measured:.1f}"
            if reference is not None:
                fields["torch_efficiency"] = f"{case.gpipe_ideal_ms() / reference:.3f}"
        name = case.schedule + (f" v={case.v}" if case.v > 1 else "")
        print(
            f"{name:>15} {f'{case.f:g}/{case.b:g}/{case.w:g}':>10} {measured:9.1f} "
            f"{predicted:9.1f} {measured / predicted - 1:+7.2%} {predicted / measured:6.3f} "
            f"{calibrated:10.1f} {measured / calibrated - 1:+7.2%} "
            f"{own:9.1f} {measured / own - 1:+7.2%} "
            f"{case.gpipe_ideal_ms():11.1f} "
            + (f"{reference:8.1f}" if reference is not None else f"{'-':>8}")
        )
        results.append(fields)
    for fields in results:
        print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
