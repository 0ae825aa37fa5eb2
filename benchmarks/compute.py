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

    python benchmarks/compute.py --distributed
    python benchmarks/compute.py --distributed --microbatches 4 8 16 --steps 10

With ``--dp D --pp P`` it compares layouts of the same D*P processes on the transformer
instead: D replicas of a P-stage pipeline, a pipeline over all D*P processes, and plain
data parallelism (torch's DistributedDataParallel over D*P ranks), each on the same global
batch, with the step time and per rank the bytes of model state (weights, gradients and
AdamW's two moments) and the peak resident memory of the process:

    python benchmarks/compute.py --distributed --dp 2 --pp 2
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import gpipe.distributed as gd

_TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


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


def plain(name: str, ms: list[int], steps: int) -> dict[int, float]:
    """One process, one thread: seconds per step of gradient accumulation over M chunks."""
    torch.set_num_threads(1)
    build, shape = MODELS[name]
    model = build()
    x, y = _batch(shape)
    out = {}
    for m in ms:
        times = []
        for step in range(steps + 1):
            began = time.perf_counter()
            for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                (F.mse_loss(model(xs), ys) * xs.shape[0] / x.shape[0]).backward()
            if step:
                times.append(time.perf_counter() - began)
            model.zero_grad()
        out[m] = statistics.median(times)
    return out


def ours(name: str, ms: list[int], schedules: list[str], steps: int) -> dict[str, float]:
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
            out[f"{schedule}/{m}"] = statistics.median(times)
            pipe.close()
    return out if rank == 0 else {}


def theirs(name: str, ms: list[int], schedules: list[str], steps: int) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, world = gd.init()
    build, shape = MODELS[name]
    x, y = _batch(shape)
    out = {}
    for schedule in schedules:
        for m in ms:
            model = build()
            per = len(model) // world
            stage_module = nn.Sequential(*list(model)[rank * per : (rank + 1) * per])
            stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
            runner = getattr(pipelining, _TORCH[schedule])(stage, m, loss_fn=F.mse_loss)
            times = []
            for step in range(steps + 1):
                dist.barrier()
                began = time.perf_counter()
                if rank == 0:
                    runner.step(x)
                else:
                    runner.step(target=y, losses=[])
                if step:
                    times.append(time.perf_counter() - began)
                stage_module.zero_grad()
            out[f"{schedule}/{m}"] = statistics.median(times)
    return out if rank == 0 else {}


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


def run(args: argparse.Namespace) -> None:
    if not args.distributed:
        raise SystemExit("compute.py measures the distributed runtime: pass --distributed")
    if args.dp or args.pp:
        if not (args.dp and args.pp) or args.dp < 1 or args.pp < 2 or 4 % args.pp:
            raise SystemExit(
                f"--dp {args.dp} --pp {args.pp}: give both, with --pp 2 or 4 (the transformer "
                "has 4 layers)"
            )
        run_layouts(args)
        return
    results = []
    for name in args.models:
        base = plain(name, args.microbatches, args.steps)
        mine = gd.spawn(ours, 2, name, args.microbatches, args.schedules, args.steps, threads=1)[0]
        torch_s = (
            {}
            if args.no_torch
            else gd.spawn(
                theirs, 2, name, args.microbatches, args.schedules, args.steps, threads=1
            )[0]
        )
        for schedule in args.schedules:
            for m in args.microbatches:
                key = f"{schedule}/{m}"
                results.append((name, schedule, m, base[m], mine[key], torch_s.get(key)))
    print("2 processes x 1 thread vs plain training in 1 process x 1 thread, same micro-batches")
    print(
        f"{'model':>12} {'schedule':>8} {'M':>3} {'plain ms':>9} {'ours ms':>9} {'speedup':>8}"
        f" {'ideal':>6} {'of ideal':>9} {'torch ms':>9} {'torch/ours':>10}"
    )
    for name, schedule, m, base, mine, torch_s in results:
        ideal = 2 * m / (m + 1)
        speedup = base / mine
        shown = f"{torch_s * 1e3:9.1f} {torch_s / mine:10.3f}" if torch_s else f"{'-':>9} {'-':>10}"
        print(
            f"{name:>12} {schedule:>8} {m:>3} {base * 1e3:9.1f} {mine * 1e3:9.1f} "
            f"{speedup:8.3f} {ideal:6.3f} {speedup / ideal:9.3f} {shown}"
        )
    for name, schedule, m, base, mine, torch_s in results:
        ideal = 2 * m / (m + 1)
        extra = (
            f" torch_ms={torch_s * 1e3:.1f} torch_over_ours={torch_s / mine:.3f}" if torch_s else ""
        )
        print(
            f"RESULT model={name} schedule={schedule} microbatches={m} plain_ms={base * 1e3:.1f} "
            f"ours_ms={mine * 1e3:.1f} speedup={base / mine:.3f} ideal={ideal:.3f} "
            f"of_ideal={base / mine / ideal:.3f}{extra}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", action="store_true", help="run the 2-process pipeline")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=list(_TORCH))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument("--dp", type=int, default=0, help="replicas (with --pp): layouts mode")
    parser.add_argument("--pp", type=int, default=0, help="pipeline stages (with --dp)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
