"""Every schedule on one model of known latency: measured step vs simulated, bubble, memory.

The model is 2K SleepLayers of F = B = W = 10 ms (forward, input gradient, weight gradient),
so each device's share costs 20 ms for each of F, B and W whether a device holds one stage
of two layers (gpipe, 1f1b, zb-h1, zb-h2, auto) or two stages of one layer (interleaved,
interleaved-zb and looped-bfs round-robin; zb-v, v-half, v-min and dualpipev in a V): the
same model, the same work. Schedules without W actions pay B + W in their backward.
dualpipev runs where M >= 2K; on CPU its fused pairs run their two halves one after the
other (no overlap), so a pair costs its parts' sum, the simulator's ``Costs(fused=1.0)``.
"auto" is searched under these costs at two memory limits, K and 2K-1 micro-batches (one
stage per device).

For each schedule and M the run reports the measured step time (median over steps), the
simulator's step time under the nominal costs (the schedule's step with zero overhead) and
the error against it; "own", the error against the simulator fed the step's own measured
action durations (what hand-offs and waits cost, without what each sleep overshoots); the
bubble: measured (the idle share of the last measured step's timeline), simulated, and the
schedule's closed form (``gpipe.analysis.bubble_formula``; for dualpipev the published
``(K-1)(F&B + B - 3W)``, steps back to back, beside the simulated bubble back to back);
and the peak memory per device: in the schedule's own unit (micro-batches of one stage
held, from F to its W or B), counted on the measured timeline's actions, simulated, and
the closed form (``gpipe.analysis.memory_formula``); and in bytes, predicted by the memory
walk the planner uses (gpipe.analysis.activation_peaks on a profile of the layers: inputs,
gradients sent and received, what B keeps for W) beside what the runtime measured.
torch.distributed.pipelining runs the schedules it has (GPipe, 1F1B, Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) on the same layers, one process
per device; it has no ZB-H1, ZB-H2, V-Half, V-Min or search.

    python benchmarks/schedules.py                 # K=4, M=8 and 16, every schedule
    python benchmarks/schedules.py --quick         # M=8, 3 steps, no torch
    python benchmarks/schedules.py --plot docs/images/schedules.png   # the stacked timelines

The runtime is local (one thread per device) or, with ``--runtime distributed``, one process
per device (gloo; each case is launched afresh by ``gd.spawn``):

    python benchmarks/schedules.py --runtime distributed --microbatches 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

import torch_reference
from gpipe import GPipe
from gpipe.analysis import (
    Costs,
    Timeline,
    activation_peaks,
    bubble_formula,
    memory_formula,
    search,
    simulate,
)
from gpipe.balance import Profile, profile
from gpipe.models import sleep_stages
from gpipe.schedule import BACKWARD, FORWARD, SCHEDULES, WEIGHT, Schedule, make_schedule

WIDTH = 256  # floats per sample: a micro-batch's input is rows x WIDTH x 4 bytes
# Two stages per device: the looped schedules take any v (2 here), the V schedules only 2.
TWO_STAGES = {"interleaved", "interleaved-zb", "looped-bfs", "zb-v", "v-half", "v-min", "dualpipev"}


def mean_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that keeps no tensor for its backward, so the last stage holds only its input
    per micro-batch, as every other stage does (mse_loss would keep two more)."""
    return output.mean() + 0 * target.mean()


@dataclass(frozen=True)
class Case:
    """One schedule: its name, stages per device, and for "auto" the memory limit."""

    name: str
    v: int = 1
    limit: int | None = None

    @property
    def label(self) -> str:
        if self.name == "auto":
            return f"auto@{self.limit}"
        looped = self.name in torch_reference.TORCH_LOOPED_SCHEDULES
        return self.name + (f" v={self.v}" if looped else "")

    def fits(self, k: int, m: int) -> bool:
        """Whether the schedule runs K devices and M micro-batches (dualpipev: M >= 2K)."""
        return self.name != "dualpipev" or m >= 2 * k

    def schedule(self, k: int, m: int, layer_ms: float) -> Schedule:
        """The schedule for K devices and M micro-batches, "auto" searched under the costs."""
        if self.name == "auto":
            stage_ms = layer_ms * 2 / self.v
            costs = Costs(forward=stage_ms, backward=stage_ms, weight=stage_ms)
            return search(k, m, virtual_stages=self.v, costs=costs, memory_limit=self.limit)
        return make_schedule(self.name, k, m, virtual_stages=self.v)


def cases(k: int) -> list[Case]:
    """Every named schedule (two stages per device where it takes them), then "auto" at
    memory limits K and 2K-1."""
    named = [Case(name, v=2 if name in TWO_STAGES else 1) for name in SCHEDULES if name != "auto"]
    return [*named, Case("auto", limit=k), Case("auto", limit=2 * k - 1)]


@dataclass
class Measured:
    """What one runtime measured for one schedule."""

    step_ms: float
    steps_ms: list[float]
    timeline: Timeline
    peak_bytes: list[float]
    own_ms: float  # the simulator fed this step's own action durations


class Runner(Protocol):
    """A runtime that runs a schedule on the benchmark model and times it."""

    name: str

    def run(self, schedule: Schedule, k: int, m: int, layer_ms: float, steps: int) -> Measured:
        """Median and per-step times of ``train_step``, and the last step's timeline."""


class LocalRunner:
    """The in-process runtime: one worker thread per device."""

    name = "local"

    def run(self, schedule: Schedule, k: int, m: int, layer_ms: float, steps: int) -> Measured:
        layers = 2 * k
        v = schedule.virtual_stages
        pipe = GPipe(
            sleep_stages(layers, layer_ms, layer_ms, layer_ms),
            [2 // v] * (k * v),
            devices=["cpu"] * k,
            chunks=m,
            checkpoint="never",
            schedule=schedule,
            virtual_stages=v,
        )
        # NOTE: the input requires grad so stage 0 runs B and W apart like every other stage,
        # as the cost model says; without it SleepLayer moves stage 0's B onto its W.
        x = torch.randn(m, WIDTH, requires_grad=True)
        target = torch.randn(m, WIDTH)
        pipe.train_step(x, target, mean_loss)  # warm-up
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            pipe.train_step(x, target, mean_loss)
            times.append((time.perf_counter() - began) * 1e3)
        own = pipe.predicted_timeline().makespan * 1e3
        return Measured(
            statistics.median(times), times, pipe.timeline, pipe.timeline.peak_memory, own
        )


def _distributed_steps(
    schedule: Schedule, k: int, m: int, layer_ms: float, steps: int
) -> Measured | None:
    """On every rank: the same model and steps as LocalRunner, one stage set per process."""
    import gpipe.distributed as gd

    rank, _ = gd.init()
    v = schedule.virtual_stages
    pipe = gd.DistributedGPipe(
        sleep_stages(2 * k, layer_ms, layer_ms, layer_ms),
        [2 // v] * (k * v),
        chunks=m,
        checkpoint="never",
        schedule=schedule,
        virtual_stages=v,
    )
    torch.manual_seed(0)
    x = torch.randn(m, WIDTH, requires_grad=True)
    target = torch.randn(m, WIDTH)
    pipe.train_step(x, target, mean_loss)  # warm-up
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        pipe.train_step(x, target, mean_loss)
        times.append((time.perf_counter() - began) * 1e3)
    timeline = pipe.timeline  # every rank takes part in gathering it
    own = pipe.predicted_timeline().makespan * 1e3
    pipe.close()
    if rank != 0:
        return None
    return Measured(statistics.median(times), times, timeline, timeline.peak_memory, own)


class DistributedRunner:
    """The multi-process runtime: one process per device (gloo), launched by gd.spawn."""

    name = "distributed"

    def run(self, schedule: Schedule, k: int, m: int, layer_ms: float, steps: int) -> Measured:
        import gpipe.distributed as gd

        measured = gd.spawn(_distributed_steps, k, schedule, k, m, layer_ms, steps, threads=1)[0]
        assert measured is not None
        return measured


def predicted_bytes(schedule: Schedule, layers: Profile) -> list[float]:
    """Per device, the peak bytes the planner's memory walk predicts for this schedule."""
    per = 2 // schedule.virtual_stages
    spans = [(s * per, (s + 1) * per) for s in range(schedule.stages)]
    full = [layers.stage_activation_bytes(a, b) for a, b in spans]
    kept = [layers.input_bytes[a] for a, _ in spans]
    deferred = [sum(layers.deferred_bytes[a:b]) for a, b in spans]
    # The input takes a gradient here, so every stage sends one back, the size of its input.
    return activation_peaks(schedule, full, kept, "never", gradient=kept, deferred=deferred)


def held_units(timeline: Timeline, schedule: Schedule) -> list[int]:
    """Per device, the most stage-micro-batches held at once, on the actions as they ran:
    one from a micro-batch's F on a stage to its W (its B, where the schedule has no W);
    a fused pair's forward counts before its backward frees."""
    weighed = {(a.stage, a.microbatch) for _, a in schedule for a in a.units if a.kind == WEIGHT}
    peaks = []
    for events in timeline.events:
        held = peak = 0
        for event in events:
            for part in event.action.units:
                if part.kind == FORWARD:
                    held += 1
                    peak = max(peak, held)
                elif part.kind == WEIGHT or (
                    part.kind == BACKWARD and (part.stage, part.microbatch) not in weighed
                ):
                    held -= 1
        peaks.append(peak)
    return peaks


def published_bubble(k: int, m: int, fused: float = 1.0) -> float:
    """DualPipeV's published bubble, ``(K-1)(F&B + B - 3W)`` with B the full backward and F&B
    a pair at ``fused`` times its parts, as a share of a device's span back to back, with
    F = B = W = 1 per stage (work 6M): 2(K-1) / (6M + 2(K-1)) for unfused pairs."""
    idle = (k - 1) * (3 * fused + 2 - 3)
    return idle / (6 * m + idle)


def torch_ms(name: str, k: int, ms: list[int], layer_ms: float, steps: int) -> dict[int, float]:
    """Median ms per step of torch.distributed.pipelining for each M, where it has the
    schedule (one set of processes runs every M); empty where it has none."""
    looped = name in torch_reference.TORCH_LOOPED_SCHEDULES
    if name not in torch_reference.TORCH_SCHEDULES and not looped:
        return {}
    two = name in TWO_STAGES
    times = torch_reference.step_times_by_microbatches(
        sleep_stages,
        (2 * k, layer_ms, layer_ms, layer_ms),
        [1] * (2 * k) if two else [2] * k,
        schedule=name,
        batches={m: (torch.randn(m, WIDTH), torch.randn(m, WIDTH)) for m in ms},
        loss_fn=mean_loss,
        steps=steps,
        timeout=600.0,
        virtual_stages=2 if looped else 1,
    )
    return {m: statistics.median(t) * 1e3 for m, t in times.items()}


def _shrink(path: Path) -> None:
    """Fewer colours, so the picture is small enough to keep in the repository."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=32, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def _formula(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", "-K", type=int, default=4)
    parser.add_argument("--microbatches", "-M", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--layer-ms", type=float, default=10.0, help="F = B = W of each of the 2K layers (ms)"
    )
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--runtime", choices=["local", "distributed"], default="local")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed")
    parser.add_argument("--quick", action="store_true", help="M=8, 3 steps, no torch")
    parser.add_argument("--plot", metavar="PNG", help="save the measured timelines, stacked")
    args = parser.parse_args()
    if args.quick:
        args.microbatches, args.steps, args.no_torch = [8], 3, True
    runner: Runner = DistributedRunner() if args.runtime == "distributed" else LocalRunner()
    k, layer_ms = args.stages, args.layer_ms

    print(
        f"K={k}, {2 * k} SleepLayers of F=B=W={layer_ms:g} ms ({2 * layer_ms:g} ms per device "
        f"share); runtime={runner.name}; times in ms; bubble measured / simulated / formula "
        "(one step alone); back to back simulated / formula (dualpipev's published one); "
        "peak memory in micro-batches of one stage (the schedule's unit; measured = counted "
        "on the measured actions, the most on any device) and in KiB (a micro-batch's input "
        "is 1 KiB)"
    )
    # torch first, each schedule's every M in one set of processes
    reference: dict[tuple[str, int], float] = {}
    for case in [] if args.no_torch else cases(k):
        ms = [m for m in args.microbatches if case.fits(k, m)]
        if case.name != "auto" and ms:
            for m, ms_per_step in torch_ms(case.name, k, ms, layer_ms, args.steps).items():
                reference[case.name, m] = ms_per_step
    header = (
        f"{'schedule':>17} {'M':>3} {'measured':>9} {'simulated':>9} {'error':>7} {'own':>7} "
        f"{'bubble m/s/formula':>20} {'b2b s/formula':>14} {'peak mb m/s/f':>14} "
        f"{'predicted KiB':>14} {'measured KiB':>14} {'torch':>7}"
    )
    print(header)
    layers = profile(
        sleep_stages(2 * k, layer_ms, layer_ms, layer_ms),
        torch.randn(1, WIDTH, requires_grad=True),
        repeats=1,
        split_backward=True,
    )
    results: list[dict[str, object]] = []
    shown: dict[int, list[tuple[str, Timeline]]] = {}
    for m in args.microbatches:
        for case in cases(k):
            if not case.fits(k, m):
                print(f"{case.label:>17} {m:>3} not run: needs M >= 2K = {2 * k}")
                continue
            schedule = case.schedule(k, m, layer_ms)
            v = schedule.virtual_stages
            stage_ms = 2 * layer_ms / v
            predicted = simulate(schedule, Costs(stage_ms, stage_ms, stage_ms))
            measured = runner.run(schedule, k, m, layer_ms, args.steps)
            torch_step = reference.get((case.name, m))
            shown.setdefault(m, []).append((case.label, measured.timeline))
            error = measured.step_ms / predicted.makespan - 1
            own_error = measured.step_ms / measured.own_ms - 1
            bubble = measured.timeline.bubble
            formula = bubble_formula(case.name, k, m, v)
            steady_formula = published_bubble(k, m) if case.name == "dualpipev" else None
            held = held_units(measured.timeline, schedule)
            memory = memory_formula(case.name, k, m, v)
            sim_peak = ",".join(f"{p:g}" for p in predicted.peak_memory)
            walk = ",".join(f"{b / 1024:g}" for b in predicted_bytes(schedule, layers))
            real = ",".join(f"{b / 1024:g}" for b in measured.peak_bytes)
            memory_text = f"{max(held)}/{max(predicted.peak_memory):g}/" + (
                "-" if memory is None else f"{memory:g}"
            )
            print(
                f"{case.label:>17} {m:>3} {measured.step_ms:9.1f} {predicted.makespan:9.1f} "
                f"{error:+7.2%} {own_error:+7.2%} "
                f"{f'{bubble:.3f}/{predicted.bubble:.3f}/{_formula(formula, 3)}':>20} "
                f"{f'{predicted.steady_bubble:.3f}/{_formula(steady_formula, 3)}':>14} "
                f"{memory_text:>14} {walk:>14} {real:>14} "
                + (f"{torch_step:7.1f}" if torch_step is not None else f"{'-':>7}")
            )
            fields: dict[str, object] = {
                "runtime": runner.name,
                "schedule": case.name,
                "label": case.label.replace(" ", "-").replace("=", ""),
                "stages": k,
                "microbatches": m,
                "measured_ms": f"{measured.step_ms:.1f}",
                "simulated_ms": f"{predicted.makespan:.1f}",
                "error": f"{error:.4f}",
                "own_ms": f"{measured.own_ms:.1f}",
                "error_own": f"{own_error:.4f}",
                "bubble": f"{bubble:.4f}",
                "simulated_bubble": f"{predicted.bubble:.4f}",
                "bubble_formula": _formula(formula, 4),
                "steady_bubble": f"{predicted.steady_bubble:.4f}",
            }
            if steady_formula is not None:
                fields["published_bubble"] = f"{steady_formula:.4f}"
            fields |= {
                "memory": f"{max(held)}",
                "simulated_memory": f"{max(predicted.peak_memory):g}",
                "memory_formula": "-" if memory is None else f"{memory:g}",
                "peak_memory": sim_peak,
                "measured_memory": ",".join(map(str, held)),
                "predicted_kib": walk,
                "measured_kib": real,
            }
            if torch_step is not None:
                fields["torch_ms"] = f"{torch_step:.1f}"
            results.append(fields)
    for fields in results:
        print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))
    for m in args.microbatches:
        by = {r["label"]: r for r in results if r["microbatches"] == m}
        v, one = by["zb-v"], by["1f1b"]
        measured_gain = float(one["measured_ms"]) / float(v["measured_ms"]) - 1
        predicted_gain = float(one["simulated_ms"]) / float(v["simulated_ms"]) - 1
        worst = max(abs(float(r["error"])) for r in by.values())
        fastest = min(by.values(), key=lambda r: float(str(r["measured_ms"])))
        least = min(float(str(r["simulated_ms"])) for r in by.values())
        simulated_best = ",".join(
            str(r["label"]) for r in by.values() if float(str(r["simulated_ms"])) == least
        )
        print(
            f"RESULT runtime={runner.name} stages={k} microbatches={m} "
            f"zb_v_faster_than_1f1b_measured={measured_gain:.4f} "
            f"predicted={predicted_gain:.4f} worst_abs_error={worst:.4f} "
            f"fastest_measured={fastest['label']} fastest_simulated={simulated_best}"
        )
    if args.plot:
        m = args.microbatches[0]
        (label, first), *rest = shown[m]
        path = first.plot(
            args.plot,
            compare=[t for _, t in rest],
            names=[label] + [name for name, _ in rest],
            memory=False,
            title=f"every schedule, K={k}, M={m}, {2 * k} layers of F=B=W={layer_ms:g} ms "
            f"(measured, {runner.name} runtime)",
        )
        _shrink(path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
