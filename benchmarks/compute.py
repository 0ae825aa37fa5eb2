"""Real compute on CPU: a pipeline over processes vs plain training, and vs torch's pipelining.

Two processes with one intra-op thread each (so each has a core of its own) run a small
transformer (4 encoder layers, d=256, batch 64, sequence 32) and an MLP as a 2-stage
pipeline of M micro-batches, under gpipe's DistributedGPipe and under
torch.distributed.pipelining, in the same run. The baseline is plain training of the same
model in one process with one thread, over the same M micro-batches (gradient
accumulation): the work a pipeline spreads over two cores. With two equal stages and free
messages the best a 2-stage pipeline can do is ``2M / (M + 1)`` times the plain speed (the
fill and drain leave one core idle for one micro-batch each way); ``of_ideal`` is the
speedup measured over that.

Everything is measured in turns, in the same two processes of one launch: per model,
``--rounds`` times, plain training on rank 0 alone (rank 1 idle at a barrier), plain
training on both ranks at once, ours for each schedule, then torch's for each schedule.
Each figure is the median of ``--steps`` timed steps after a warm-up step; each cell's, the
median over the rounds. Measured in separate launches, the sides met different loads on
this shared machine and the ratios drifted by 5-25% between runs; in turns, all see the
same drift.

Two busy processes need not each run at the speed of one alone (shared caches and memory
bandwidth, clock, the machine's other load), so the plain step with both ranks busy at once
(``plain2_ms``) is what each stage of a pipeline can hope for here, and
``machine_ideal = ideal * plain_ms / plain2_ms`` the best a 2-stage pipeline can reach on
this machine. This separates the two causes of a low ``of_ideal``: ``machine_ideal`` below
``ideal`` is the machine's limit; ``of_machine = speedup / machine_ideal`` below 1 is the
pipeline's own overhead (messages, bookkeeping, waits). Short runs are noisy: turn-to-turn
swings of 10-20% were seen with 3 steps, so ``machine_ideal`` can even come out above
``ideal``; more steps and rounds steady it. Under outside load the reverse happens too: two
fully busy plain processes suffer more than pipeline stages that are partly idle (fill,
drain, waits), and ``of_machine`` comes out above 1.

    python benchmarks/compute.py --distributed
    python benchmarks/compute.py --distributed --microbatches 4 8 16 --steps 10 --rounds 5

With ``--dp D --pp P`` it compares layouts of the same D*P processes on the transformer
instead: D replicas of a P-stage pipeline, a pipeline over all D*P processes, and plain
data parallelism (torch's DistributedDataParallel over D*P ranks), each on the same global
batch, with the step time and per rank the bytes of model state (weights, gradients and
AdamW's two moments) and the peak resident memory of the process:

    python benchmarks/compute.py --distributed --dp 2 --pp 2

With ``--engines`` as well it measures instead the data-parallel engines of the same D x P
pipe in turns, in the same processes: gpipe's own all-reduce ("replicate"), torch's DDP and
FSDP2 per stage (see gpipe.distributed.data_parallel; "fsdp_gathered" keeps the parameters
gathered between forwards), each rank's model state as held:

    python benchmarks/compute.py --distributed --dp 2 --pp 2 --engines

With ``--layers`` it asks where a 2-stage pipeline's shortfall goes: each rank times every
forward of its two transformer layers (wall and the thread's own CPU time, by forward
hooks), run three ways in turns in the same two processes: the rank's stage alone, forward
and backward micro-batch by micro-batch with both ranks busy at once (the work a stage
does, without a pipeline around it), inside ours (1F1B), and inside torch's Schedule1F1B.
A layer that costs more CPU inside a pipeline than alone is slower for reasons of the
pipeline's making (what runs between its calls, fresh inputs from the network), not for
waiting:

    python benchmarks/compute.py --distributed --layers
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import gpipe.distributed as gd
from latency_distributed import SCHEDULES
from torch_reference import run_step, torch_runner


def transformer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True) for _ in range(4)]
    )


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers)


MODELS = {
    "transformer": (transformer, (64, 32, 256)),
    "mlp": (mlp, (64, 1024)),
}


def _batch(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


Key = tuple[str, int]  # (schedule, M)


def plain(name: str, ms: list[int], steps: int, together: bool = False) -> dict[int, float]:
    """One process, one thread: seconds per step of gradient accumulation over M chunks.

    With ``together``, a barrier before each step, so that every rank starts it at once.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    build, shape = MODELS[name]
    model = build()
    x, y = _batch(shape)
    out = {}
    for m in ms:
        times = []
        for step in range(steps + 1):
            if together:
                dist.barrier()
            began = time.perf_counter()
            for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                (F.mse_loss(model(xs), ys) * xs.shape[0] / x.shape[0]).backward()
            if step:
                times.append(time.perf_counter() - began)
            model.zero_grad()
        out[m] = statistics.median(times)
    return out


def ours(name: str, ms: list[int], schedules: list[str], steps: int) -> dict[Key, float]:
    """On every rank: seconds per train_step of DistributedGPipe (rank 0's; {} elsewhere)."""
    rank, world = gd.init()
    build, shape = MODELS[name]
    x, y = _batch(shape)
    out = {}
    for schedule in schedules:
        for m in ms:
            model = build()
            layers = len(model)
            balance = [layers // world] * world
            pipe = gd.DistributedGPipe(
                model, balance, chunks=m, schedule=schedule, checkpoint="never"
            )
            times = []
            for step in range(steps + 1):
                began = time.perf_counter()
                pipe.train_step(x, y, F.mse_loss)
                if step:
                    times.append(time.perf_counter() - began)
                pipe.zero_grad()
            out[schedule, m] = statistics.median(times)
            pipe.close()
    return out if rank == 0 else {}


def theirs(name: str, ms: list[int], schedules: list[str], steps: int) -> dict[Key, float]:
    """On every rank: seconds per step of torch.distributed.pipelining (rank 0's)."""
    import torch.distributed as dist

    rank, world = gd.init()
    build, shape = MODELS[name]
    x, y = _batch(shape)
    out = {}
    for schedule in schedules:
        for m in ms:
            model = build()
            stage_module = nn.Sequential(*_share(model, rank, world))
            runner = torch_runner(stage_module, rank, world, schedule, m, F.mse_loss)
            times = []
            for step in range(steps + 1):
                dist.barrier()
                began = time.perf_counter()
                run_step(runner, rank == 0, rank == world - 1, x, y)
                if step:
                    times.append(time.perf_counter() - began)
                stage_module.zero_grad()
            out[schedule, m] = statistics.median(times)
    return out if rank == 0 else {}


def both(
    names: list[str],
    ms: list[int],
    schedules: list[str],
    steps: int,
    rounds: int,
    torch_too: bool,
) -> dict[str, dict[str, dict[Any, float]]]:
    """On every rank: plain alone, plain two at once, ours and torch's in turns, per model.

    NOTE: run one after the other (plain here, ours and torch's in two launches), the sides
    met different loads on this shared machine: the same command's ratios drifted by 5-25%.
    In turns, in the same processes, all see the same drift; each figure is the median over
    its rounds.

    Returns:
        On rank 0, per model: "plain" and "plain2" (two at once) by M, "ours" and "torch"
        by (schedule, M), in seconds per step; {} on the other rank.
    """
    import torch.distributed as dist

    rank, world = gd.init()
    out = {}
    for name in names:
        runs: dict[str, dict[Any, list[float]]] = {"plain": {}, "plain2": {}, "ours": {}}
        if torch_too:
            runs["torch"] = {}
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:  # rank 1 waits idle at the barrier below
                _add(runs["plain"], plain(name, ms, steps))
            dist.barrier()
            medians: list[dict[int, float]] = [{} for _ in range(world)]
            dist.all_gather_object(medians, plain(name, ms, steps, together=True))
            _add(runs["plain2"], {m: statistics.mean(r[m] for r in medians) for m in ms})
            dist.barrier()
            _add(runs["ours"], ours(name, ms, schedules, steps))
            if torch_too:
                _add(runs["torch"], theirs(name, ms, schedules, steps))
        out[name] = {
            side: {key: statistics.median(t) for key, t in times.items()}
            for side, times in runs.items()
        }
    return out if rank == 0 else {}


def _share(model: nn.Sequential, rank: int, world: int) -> list[nn.Module]:
    """The layers of ``rank``'s stage when ``model`` is cut into ``world`` equal stages."""
    per = len(model) // world
    return list(model)[rank * per : (rank + 1) * per]


def _add(runs: dict[Any, list[float]], figures: dict[Any, float]) -> None:
    """Append one turn's figures to each key's list of runs."""
    for key, seconds in figures.items():
        runs.setdefault(key, []).append(seconds)


def _state_bytes(params: list[nn.Parameter], shards: int = 1) -> int:
    """Weights and gradients, plus AdamW's two moments (split ``shards`` ways under ZeRO)."""
    weights = sum(p.numel() * p.element_size() for p in params)
    return 2 * weights + 2 * weights // shards


def layout_step(dp: int, pp: int, m: int, steps: int) -> dict[str, float]:
    """On every rank: one layout's median step, model-state bytes and peak RSS (rank's own)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = gd.init()
    model = transformer()
    x, y = _batch(MODELS["transformer"][1])
    if pp == 1:  # plain data parallelism: each rank its share of the batch, no pipeline
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]

        def step() -> None:
            F.mse_loss(ddp(xs), ys).backward()
            optimizer.step()
            optimizer.zero_grad()

        params = list(model.parameters())
    else:
        pipe = gd.DistributedGPipe(
            model, [len(model) // pp] * pp, chunks=m, schedule="1f1b", checkpoint="never",
            dp_size=dp,
        )  # fmt: skip
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

        def step() -> None:
            pipe.train_step(x, y, F.mse_loss)
            optimizer.step()
            optimizer.zero_grad()

        params = list(pipe.parameters())
    times = []
    for i in range(steps + 1):
        dist.barrier()
        began = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - began)
    if pp > 1:
        pipe.close()
    return {
        "step": statistics.median(times),
        "state": _state_bytes(params),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# label: (data_parallel, fsdp_reshard_after_forward)
ENGINES = {
    "replicate": ("replicate", True),
    "ddp": ("ddp", True),
    "fsdp": ("fsdp", True),
    "fsdp_gathered": ("fsdp", False),
}


def engine_turns(dp: int, pp: int, m: int, steps: int, rounds: int) -> dict[str, Any]:
    """On every rank: each engine's pipe, in turns; per engine the median step over every
    turn (rank 0's clock, each step ends at a barrier) and this rank's model-state bytes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gd.init()
    x, y = _batch(MODELS["transformer"][1])
    steps_of: dict[str, Callable[[], None]] = {}
    state: dict[str, int] = {}
    for engine in ENGINES:
        model = transformer()
        pipe = gd.DistributedGPipe(
            model, [len(model) // pp] * pp, chunks=m, schedule="1f1b", checkpoint="never",
            dp_size=dp, data_parallel=ENGINES[engine][0],
            fsdp_reshard_after_forward=ENGINES[engine][1],
        )  # fmt: skip
        optimizer = pipe.make_optimizer(torch.optim.AdamW, lr=1e-4)

        def step(pipe: Any = pipe, optimizer: Any = optimizer) -> None:
            pipe.train_step(x, y, F.mse_loss)
            optimizer.step()
            optimizer.zero_grad()

        steps_of[engine] = step
        local = [p.to_local() if isinstance(p, DTensor) else p for p in pipe.parameters()]
        state[engine] = _state_bytes(local)  # type: ignore[arg-type]
    runs: dict[str, list[float]] = {engine: [] for engine in ENGINES}
    for _ in range(rounds):
        for engine in ENGINES:
            for i in range(steps + 1):
                dist.barrier()
                began = time.perf_counter()
                steps_of[engine]()
                dist.barrier()
                if i:
                    runs[engine].append(time.perf_counter() - began)
    return {"step": {e: statistics.median(r) for e, r in runs.items()}, "state": state}


def run_engines(args: argparse.Namespace) -> None:
    """The engines of one D x P layout, in turns: a table and a RESULT line."""
    world = args.dp * args.pp
    m = args.microbatches[0]
    ranks = gd.spawn(engine_turns, world, args.dp, args.pp, m, args.steps, args.rounds, threads=1)
    step = ranks[0]["step"]
    state = {e: max(r["state"][e] for r in ranks.values()) for e in ENGINES}
    print(
        f"transformer (4 layers, d=256), global batch 64, dp{args.dp} x pp{args.pp}, "
        f"{world} processes x 1 thread, M={m} per pipeline, 1f1b, AdamW, "
        f"{args.rounds} turns x {args.steps} steps"
    )
    print(f"{'engine':>14} {'step ms':>9} {'of replicate':>13} {'state MiB/rank':>15}")
    for e in ENGINES:
        print(
            f"{e:>14} {step[e] * 1e3:9.1f} {step[e] / step['replicate']:13.3f} "
            f"{state[e] / 2**20:15.1f}"
        )
    print(
        f"RESULT engines dp={args.dp} pp={args.pp} microbatches={m} "
        + " ".join(f"{e}_ms={step[e] * 1e3:.1f}" for e in ENGINES)
        + f" ddp_over_replicate={step['ddp'] / step['replicate']:.3f}"
        + f" fsdp_over_replicate={step['fsdp'] / step['replicate']:.3f} "
        + " ".join(f"state_mib_{e}={state[e] / 2**20:.1f}" for e in ENGINES)
    )


def run_layouts(args: argparse.Namespace) -> None:
    """D x P against a P*D pipeline and DDP over D*P ranks, same global batch."""
    world = args.dp * args.pp
    m = args.microbatches[0]
    layouts = [(args.dp, args.pp), (1, world), (world, 1)]
    rows = []
    for dp, pp in layouts:
        ranks = gd.spawn(layout_step, world, dp, pp, m, args.steps, threads=1)
        step = statistics.median(r["step"] for r in ranks.values())
        state = max(r["state"] for r in ranks.values())
        rss = max(r["rss"] for r in ranks.values())
        rows.append((dp, pp, step, state, rss))
    print(
        f"transformer (4 layers, d=256), global batch 64, {world} processes x 1 thread, "
        f"M={m} per pipeline, 1f1b, AdamW"
    )
    print(f"{'layout':>12} {'step ms':>9} {'state MiB/rank':>15} {'peak RSS MiB/rank':>18}")
    for dp, pp, step, state, rss in rows:
        name = "DDP" if pp == 1 else f"dp{dp} x pp{pp}"
        print(f"{name:>12} {step * 1e3:9.1f} {state / 2**20:15.1f} {rss / 2**20:18.1f}")
    (_, _, mixed, mixed_state, mixed_rss), (_, _, deep, _, _), (_, _, ddp, ddp_state, _) = rows
    print(
        f"RESULT dp={args.dp} pp={args.pp} microbatches={m} "
        f"dp_pp_ms={mixed * 1e3:.1f} pp{world}_ms={deep * 1e3:.1f} ddp{world}_ms={ddp * 1e3:.1f} "
        f"dp_pp_over_pp={deep / mixed:.3f} dp_pp_over_ddp={ddp / mixed:.3f} "
        f"state_mib_dp_pp={mixed_state / 2**20:.1f} state_mib_ddp={ddp_state / 2**20:.1f} "
        f"rss_mib_dp_pp={mixed_rss / 2**20:.1f}"
    )


def _forward_costs(
    layers: list[nn.Module], step: Callable[[], None], steps: int
) -> list[tuple[float, float]]:
    """(wall s, thread CPU s) of every forward of ``layers`` over ``steps`` calls of
    ``step`` after a warm-up call, timed by forward hooks removed afterwards."""
    calls: list[tuple[float, float]] = []
    began: list[tuple[float, float]] = []  # the running layer's start (layers never nest)

    def before(*_: Any) -> None:
        began.append((time.perf_counter(), time.thread_time()))

    def after(*_: Any) -> None:
        wall, cpu = began.pop()
        calls.append((time.perf_counter() - wall, time.thread_time() - cpu))

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(before),
                                             layer.register_forward_hook(after))]  # fmt: skip
    step()
    calls.clear()
    for _ in range(steps):
        step()
    for hook in hooks:
        hook.remove()
    return calls


def layer_costs(m: int, steps: int, rounds: int) -> dict[str, tuple[float, float]]:
    """On every rank: the median (wall s, CPU s) of one forward of this rank's layers,
    alone ("alone"), inside ours ("ours") and inside torch's 1F1B ("torch"), in turns."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = gd.init()
    x, y = _batch(MODELS["transformer"][1])
    per = len(transformer()) // world
    last = rank == world - 1

    def alone() -> list[tuple[float, float]]:
        stage = nn.Sequential(*_share(transformer(), rank, world))

        def step() -> None:
            dist.barrier()
            for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                out = stage(xs.detach().requires_grad_(rank > 0))
                if last:
                    (F.mse_loss(out, ys) / m).backward()
                else:
                    out.backward(torch.ones_like(out))

        return _forward_costs(list(stage), step, steps)

    def ours() -> list[tuple[float, float]]:
        model = transformer()
        pipe = gd.DistributedGPipe(
            model, [per] * world, chunks=m, schedule="1f1b", checkpoint="never"
        )

        def step() -> None:
            pipe.train_step(x, y, F.mse_loss)
            pipe.zero_grad()

        calls = _forward_costs(_share(model, rank, world), step, steps)
        pipe.close()
        return calls

    def theirs() -> list[tuple[float, float]]:
        stage = nn.Sequential(*_share(transformer(), rank, world))
        runner = torch_runner(stage, rank, world, "1f1b", m, F.mse_loss)

        def step() -> None:
            dist.barrier()
            run_step(runner, rank == 0, last, x, y)
            stage.zero_grad()

        return _forward_costs(list(stage), step, steps)

    sides = {"alone": alone, "ours": ours, "torch": theirs}
    timed: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, measure in sides.items():
            dist.barrier()
            timed[side] += measure()
    return {
        side: (statistics.median(w for w, _ in calls), statistics.median(c for _, c in calls))
        for side, calls in timed.items()
    }


def run_layers(args: argparse.Namespace) -> None:
    """Each rank's layer forward alone, inside ours and inside torch's: a table and RESULT."""
    m = args.microbatches[0]
    ranks = gd.spawn(layer_costs, 2, m, args.steps, args.rounds, threads=1)
    print(
        f"transformer (4 layers, d=256, batch 64), 2 processes x 1 thread, M={m}, 1f1b; one "
        "layer forward, median over every call (--rounds "
        f"{args.rounds}, --steps {args.steps}); alone: the rank's stage micro-batch by "
        "micro-batch, both ranks at once"
    )
    print(f"{'rank':>4} {'side':>6} {'wall ms':>8} {'cpu ms':>7} {'cpu / alone':>12}")
    for rank in sorted(ranks):
        cells = ranks[rank]
        for side in ("alone", "ours", "torch"):
            wall, cpu = cells[side]
            share = cpu / cells["alone"][1]
            print(f"{rank:>4} {side:>6} {wall * 1e3:8.3f} {cpu * 1e3:7.3f} {share:12.3f}")
    mean = {
        side: statistics.mean(ranks[r][side][1] for r in ranks)
        for side in ("alone", "ours", "torch")
    }
    print(
        f"RESULT layers=1 microbatches={m} alone_cpu_ms={mean['alone'] * 1e3:.3f} "
        f"ours_cpu_ms={mean['ours'] * 1e3:.3f} torch_cpu_ms={mean['torch'] * 1e3:.3f} "
        f"ours_over_alone={mean['ours'] / mean['alone']:.3f} "
        f"torch_over_alone={mean['torch'] / mean['alone']:.3f}"
    )


def run(args: argparse.Namespace) -> None:
    """The layouts, or the grid in turns in one launch: a table, then one RESULT line per cell."""
    if not args.distributed:
        raise SystemExit("compute.py measures the distributed runtime: pass --distributed")
    if args.steps < 1 or args.rounds < 1:
        raise SystemExit(f"--steps {args.steps} --rounds {args.rounds}: each must be at least 1")
    if args.dp or args.pp:
        if not (args.dp and args.pp) or args.dp < 1 or args.pp < 2 or 4 % args.pp:
            raise SystemExit(
                f"--dp {args.dp} --pp {args.pp}: give both, with --pp 2 or 4 (the transformer "
                "has 4 layers)"
            )
        if args.engines:
            run_engines(args)
            return
        run_layouts(args)
        return
    if args.layers:
        run_layers(args)
        return
    measured = gd.spawn(
        both,
        2,
        args.models,
        args.microbatches,
        args.schedules,
        args.steps,
        args.rounds,
        not args.no_torch,
        threads=1,
    )[0]
    rows = []
    for name in args.models:
        cells = measured[name]
        for schedule in args.schedules:
            for m in args.microbatches:
                base, base2 = cells["plain"][m], cells["plain2"][m]
                mine = cells["ours"][schedule, m]
                torch_s = cells.get("torch", {}).get((schedule, m))
                rows.append((name, schedule, m, base, base2, mine, torch_s))
    print(
        "2 processes x 1 thread vs plain training in 1 process x 1 thread, same micro-batches; "
        f"in turns in the same processes (--rounds {args.rounds}, --steps {args.steps})"
    )
    print(
        f"{'model':>12} {'schedule':>8} {'M':>3} {'plain ms':>9} {'plain2 ms':>10} {'ours ms':>9}"
        f" {'speedup':>8} {'ideal':>6} {'machine':>8} {'of ideal':>9} {'of machine':>11}"
        f" {'torch ms':>9} {'torch/ours':>10} {'torch of ideal':>15}"
    )
    for name, schedule, m, base, base2, mine, torch_s in rows:
        ideal = 2 * m / (m + 1)
        speedup, machine = base / mine, ideal * base / base2
        shown = (
            f"{torch_s * 1e3:9.1f} {torch_s / mine:10.3f} {base / torch_s / ideal:15.3f}"
            if torch_s
            else f"{'-':>9} {'-':>10} {'-':>15}"
        )
        print(
            f"{name:>12} {schedule:>8} {m:>3} {base * 1e3:9.1f} {base2 * 1e3:10.1f} "
            f"{mine * 1e3:9.1f} {speedup:8.3f} {ideal:6.3f} {machine:8.3f} {speedup / ideal:9.3f} "
            f"{speedup / machine:11.3f} {shown}"
        )
    for name, schedule, m, base, base2, mine, torch_s in rows:
        ideal = 2 * m / (m + 1)
        speedup, machine = base / mine, ideal * base / base2
        extra = (
            f" torch_ms={torch_s * 1e3:.1f} torch_over_ours={torch_s / mine:.3f}"
            f" torch_of_ideal={base / torch_s / ideal:.3f}"
            if torch_s
            else ""
        )
        print(
            f"RESULT model={name} schedule={schedule} microbatches={m} plain_ms={base * 1e3:.1f} "
            f"ours_ms={mine * 1e3:.1f} speedup={speedup:.3f} ideal={ideal:.3f} "
            f"of_ideal={speedup / ideal:.3f} plain2_ms={base2 * 1e3:.1f} "
            f"machine_ideal={machine:.3f} of_machine={speedup / machine:.3f}{extra}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", action="store_true", help="run the 2-process pipeline")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns of every side, in the same processes"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--dp", type=int, default=0, help="replicas (with --pp): layouts mode")
    parser.add_argument("--pp", type=int, default=0, help="pipeline stages (with --dp)")
    parser.add_argument(
        "--engines", action="store_true", help="with --dp/--pp: the data-parallel engines"
    )
    parser.add_argument(
        "--layers", action="store_true", help="a layer's forward alone vs inside each pipeline"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
