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
the layer itself, the floor any runtime pays. NOTE: the sleeps take no core, so K stage
threads overlap on a host with fewer cores (K = 4 on 2): only each action's Python and
autograd work competes for the cores and the GIL, and on a busy host each wake-up waits
for a core. The figure beyond plain (``beyond_plain_ms``) moves with the host's load,
printed at the start and the end; ``--turns`` repeats the fit, printing the median and the
spread.

Bare threads (``bare_gpipe``, ``bare_1f1b``): the same SleepLayers and schedules run by the
least a threaded pipeline does (a thread per stage, a queue per stage and direction,
autograd per micro-batch; see :class:`_Bare`). Its cost beyond plain is what Python threads
alone cost on this host, the floor for any threaded runtime; the pipe's cost beyond bare
threads (``beyond_bare_ms``) is its own.

Serial (``--serial``): the runtime's own CPU time per action, without threads. K stages
of empty SleepLayers (no sleep) on K "cpu" devices run as one lane, as the stages of one GPU
do: every device's actions on the calling thread in one dependency order (see
``gpipe.runtime.stage_set.lanes_of``), so no hand-off waits and no thread competes. Beside it,
the same stages on a thread each (as CPU stages run, and as a GPU's stages ran before they
shared a lane): with no sleep to overlap, this is work that only launches, like a GPU
stage's, and the threads only compete for the GIL.
Plain runs the same layers micro-batch by micro-batch. Both are timed by the thread's CPU
clock (``time.thread_time``), in pairs; the per-action cost is the median over pairs of
(pipe - plain) / 2KM. It is the bookkeeping (messages, random streams, memory counting,
timeline) plus the pipe's extra autograd and module calls (one backward per stage, not
one per micro-batch).

    python benchmarks/overhead.py [--microbatches 8] [--steps 30] [--stages 2 4 8]
    python benchmarks/overhead.py --no-fit        # the one-stage comparison only
    python benchmarks/overhead.py --serial        # the serial replay only
    python benchmarks/overhead.py --no-one-stage --stages 4 --turns 5 --no-torch
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch.nn import functional as F

import torch_reference
from gpipe import GPipe, scatter
from gpipe.models import GPTConfig, gpt, gpt_loss, sleep_stages, synthetic_tokens
from gpipe.schedule import FORWARD, make_schedule
from host import sleep_overshoot_us

_SCHEDULES = ("gpipe", "1f1b")


class _Bare:
    """The least a pipeline of Python threads does: the same SleepLayers and schedule, a
    thread per stage (the first on the caller's), a queue per stage and direction, autograd
    per micro-batch, and nothing else (no random streams, memory count, timeline, checks).

    Its cost beyond plain is what threads alone cost on this host (the GIL, wake-ups, the
    cores); the pipe's cost beyond it is the runtime's own.
    """

    def __init__(self, k: int, m: int, schedule: str, action_ms: float) -> None:
        self.layers = sleep_stages(k, action_ms, action_ms)
        self.actions = make_schedule(schedule, k, m).actions
        self.k, self.m = k, m
        self.pool = ThreadPoolExecutor(k - 1)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        inputs: list[queue.SimpleQueue[torch.Tensor]] = [queue.SimpleQueue() for _ in self.layers]
        grads: list[queue.SimpleQueue[torch.Tensor]] = [queue.SimpleQueue() for _ in self.layers]

        def device(s: int) -> None:
            kept = {}
            last = s == self.k - 1
            for action in self.actions[s]:
                i = action.microbatch
                if action.kind == FORWARD:
                    given = x[i : i + 1] if s == 0 else inputs[s].get().requires_grad_()
                    output = self.layers[s](given)
                    if last:
                        output = F.mse_loss(output, target[i : i + 1]) / self.m
                    else:
                        inputs[s + 1].put(output.detach())
                    kept[i] = (given, output)
                else:
                    given, output = kept.pop(i)
                    torch.autograd.backward(output, None if last else grads[s].get())
                    if s > 0:
                        grads[s - 1].put(given.grad)

        futures = [self.pool.submit(device, s) for s in range(1, self.k)]
        device(0)
        for future in futures:
            future.result()


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
        bares: list[_Bare] = []
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
            for name in _SCHEDULES:
                bare = _Bare(k, m, name, args.action_ms)
                bares.append(bare)
                runs.setdefault(f"bare_{name}", {})[m] = partial(bare.step, x, target)
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
        for bare in bares:
            bare.pool.shutdown()
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
    names = [
        *_SCHEDULES,
        *(f"bare_{n}" for n in _SCHEDULES),
        *(f"torch_{n}" for n in _SCHEDULES if not args.no_torch),
        "plain",
    ]
    print(f"{'K':>3} " + " ".join(f"{name:>12}" for name in names))
    for k, c in rows:
        print(f"{k:>3} " + " ".join(f"{c[name] * 1e3:12.3f}" for name in names))
    return fields


def _serial_cpu(
    schedule: str, k: int, m: int, steps: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per step, in rounds: the lane's CPU seconds, plain's, and a thread per stage's wall and
    CPU seconds (every thread's)."""
    pipes = []
    for lanes in ([list(range(k))], [[d] for d in range(k)]):
        pipe = GPipe(
            sleep_stages(k, 0, 0),
            [1] * k,
            devices=["cpu"] * k,
            chunks=m,
            checkpoint="never",
            schedule=schedule,
        )
        pipe._stages.lanes = lanes  # NOTE: one lane, as the stages of one GPU run; or threads
        pipes.append(pipe)
    model = sleep_stages(k, 0, 0)
    x, target = torch.randn(m, 4, requires_grad=True), torch.randn(m, 4)

    def plain() -> None:
        for xi, ti in zip(x.split(1), target.split(1)):
            (F.mse_loss(model(xi), ti) / m).backward()

    lane, threads = (partial(pipe.train_step, x, target, F.mse_loss) for pipe in pipes)
    for run in (lane, plain, threads):  # warm-up: the first step probes every layer
        run()
        run()
    found: list[list[float]] = [[], [], [], []]
    for _ in range(steps):
        for seconds, run in zip(found, (lane, plain)):
            began = time.thread_time()
            run()
            seconds.append(time.thread_time() - began)
        began, began_cpu = time.perf_counter(), time.process_time()
        threads()
        found[2].append(time.perf_counter() - began)
        found[3].append(time.process_time() - began_cpu)
    pipes[1].close()
    return found[0], found[1], found[2], found[3]


def serial(args: argparse.Namespace) -> dict[str, object]:
    """The runtime's CPU time per action, replayed on one thread; the RESULT fields."""
    k, m = args.serial_stages, args.serial_microbatches
    actions = 2 * k * m
    fields: dict[str, object] = {}
    plains: list[float] = []
    for name in _SCHEDULES:
        pipe, plain, wall, cpu = _serial_cpu(name, k, m, args.serial_steps)
        plains += plain
        beyond = statistics.median(a - b for a, b in zip(pipe, plain)) / actions
        own = statistics.median(pipe) / actions
        print(f"serial {name}, K = {k}, M = {m}: CPU per action: pipe {own * 1e6:.1f} us, "
              f"plain {statistics.median(plain) / actions * 1e6:.1f} us, "
              f"beyond plain {beyond * 1e6:.1f} us")  # fmt: skip
        print(f"  a thread per stage instead of the lane: {statistics.median(wall) * 1e3:.2f} ms "
              f"per step, {statistics.median(cpu) * 1e3:.2f} ms of CPU, against the lane's "
              f"{statistics.median(pipe) * 1e3:.2f} ms on one thread")  # fmt: skip
        key = name.replace("-", "_")
        fields[f"serial_us_{key}"] = f"{own * 1e6:.1f}"
        fields[f"serial_beyond_plain_us_{key}"] = f"{beyond * 1e6:.1f}"
        fields[f"threads_over_lane_{key}"] = (
            f"{statistics.median(wall) / statistics.median(pipe):.2f}"
        )
    fields["serial_plain_us"] = f"{statistics.median(plains) / actions * 1e6:.1f}"
    return fields


def _turns(args: argparse.Namespace) -> dict[str, object]:
    """The per-action fit, ``args.turns`` times: each figure's median over the turns and its
    spread (min..max), and each schedule's cost beyond plain sequential training."""
    turns = [per_action(args) for _ in range(args.turns)]
    if args.turns == 1:
        fields = turns[0]
    else:
        fields = {key: f"{statistics.median(float(t[key]) for t in turns):.3f}" for key in turns[0]}
    for k in args.stages:
        plain = f"action_ms_plain_k{k}"
        for name in _SCHEDULES:
            key = name.replace("-", "_")
            mine, bare = f"action_ms_{key}_k{k}", f"action_ms_bare_{key}_k{k}"
            for what, than, label in [(mine, plain, ""), (bare, plain, "bare_"), (mine, bare, "")]:
                beyond = [float(t[what]) - float(t[than]) for t in turns]
                middle = statistics.median(beyond)
                versus = "bare threads" if than == bare else "plain"
                print(f"K = {k}, {label}{name}: {middle:.3f} ms per action beyond {versus}, "
                      f"median of {args.turns} turns "
                      f"(spread {min(beyond):.3f}..{max(beyond):.3f})")  # fmt: skip
                field = f"beyond_{'bare' if than == bare else 'plain'}_ms_{label}{key}_k{k}"
                fields[field] = f"{middle:.3f}"
                spread = field.replace("_ms_", "_spread_")
                fields[spread] = f"{min(beyond):.3f}..{max(beyond):.3f}"
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--no-fit", action="store_true", help="only the one-stage comparison")
    parser.add_argument("--no-one-stage", action="store_true", help="skip the one-stage GPT")
    parser.add_argument("--serial", action="store_true", help="only the serial replay")
    parser.add_argument("--serial-stages", type=int, default=4, help="K of the serial replay")
    parser.add_argument("--serial-microbatches", type=int, default=32, help="its M")
    parser.add_argument("--serial-steps", type=int, default=60, help="its timed pairs")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="K to fit at")
    parser.add_argument(
        "--fit-microbatches", type=int, nargs="+", default=[8, 16, 24, 32], help="M to fit over"
    )
    parser.add_argument("--fit-steps", type=int, default=9, help="steps per (K, M) in the fit")
    parser.add_argument("--turns", type=int, default=1, help="repeat the fit; medians, spread")
    parser.add_argument("--action-ms", type=float, default=0.5, help="F and B of each stage")
    args = parser.parse_args()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the start: {load} ({os.cpu_count()} cores)")
    fields: dict[str, object] = {}
    if args.serial:
        fields.update(serial(args))
    else:
        overshoot = sleep_overshoot_us(args.action_ms / 1e3)
        print(f"this host's time.sleep({args.action_ms:g} ms) overshoots by {overshoot:.0f} us")
        if not args.no_one_stage:
            fields.update(one_stage(args))
        if not args.no_fit:
            fields.update(_turns(args))
        fields["sleep_overshoot_us"] = f"{overshoot:.0f}"
    fields["load_start"] = load.replace(" ", "/")
    fields["load_end"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
