"""Long skips sent directly vs relayed through the stages in between: bytes and step time.

The U-Net-like model (``gpipe.models.unet``) is cut at its blocks into K=4 stages
(``down.2``, ``middle``, ``up.2`` begin stages 1-3), so the two outermost skips,
``down.0``'s and ``down.1``'s outputs, the largest tensors of the model, go from stage 0 to
stage 3. ``gpipe.split`` sends each directly, once per micro-batch (and its gradient once
back); ``Stages.relayed()`` is the same model forced to hand them along the chain
0 -> 1 -> 2 -> 3, as a pipeline that only knows neighbours must. For each, M=8
micro-batches: the bytes the pipe sent (from ``pipe.timeline.transfers``) and the median
step time. The ideals: the bytes of every value crossing a cut sent once to each stage that
reads it (what direct routing should send), and the simulator's step time for the
schedule fed the step's own measured action times with free transfers
(``pipe.predicted_timeline()``). torch.distributed.pipelining runs the same model, traced
by its own ``pipeline()``, one process per stage, in the same run (its IR sends the skips
directly too; with ``--schedule 1f1b`` its Schedule1F1B hung on this model under gloo in our
runs, so the default schedule is GPipe's). Both run without re-materialization by default
(``--checkpoint never``), as torch pipelining does not recompute.

Locally (one process, a thread per stage) a message is a reference handed over, so the
bytes are what a device-to-device copy would move, and relaying costs only the extra
hand-offs; ``--distributed`` runs one process per stage (gloo), where every byte is copied.

    python benchmarks/skip.py                  # local, 64x64 images, 1 MiB skips
    python benchmarks/skip.py --distributed    # one process per stage
    python benchmarks/skip.py --quick          # smaller, fewer steps, no torch
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.nn import functional as F

import gpipe
from gpipe.dataflow import INPUT, Stages
from gpipe.models import UNetConfig, unet
from torch_reference import run_step, torch_schedule

SPLIT_POINTS = ["down.2", "middle", "up.2"]
STAGES = len(SPLIT_POINTS) + 1


def _config(width: int) -> UNetConfig:
    return UNetConfig(widths=(width, 2 * width, 4 * width, 8 * width))


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, 3, args.side, args.side)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _split(args: argparse.Namespace, x: torch.Tensor) -> Stages:
    model = unet(_config(args.width), seed=0)
    return gpipe.split(model, SPLIT_POINTS, example_inputs=(x[: args.batch // args.chunks],))


def _nbytes(value: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(value)
    return sum(leaf.nbytes for leaf in leaves if isinstance(leaf, torch.Tensor))


def ideal_bytes(stages: Stages, x: torch.Tensor, chunks: int) -> tuple[int, int]:
    """Bytes of one step if every value crossing a cut is sent once to each reader: forward
    (activations) and backward (their gradients), stage to stage (inputs excluded)."""
    microbatch = x[: x.shape[0] // chunks]
    made: dict[int, Any] = {INPUT: stages.bind(microbatch)}
    flow = stages.dataflow
    forward = backward = 0
    with torch.no_grad():
        for stage, module in enumerate(stages):
            taken = {name: made[source][name] for name, source in flow.takes[stage]}
            made[stage] = module(taken)
            for name, source in flow.takes[stage]:
                if source == INPUT:
                    continue
                size = _nbytes(taken[name])
                forward += size
                if isinstance(taken[name], torch.Tensor) and taken[name].is_floating_point():
                    backward += size
    return forward * chunks, backward * chunks


def local(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Direct and relayed in one process, alternating steps so noise lands on both alike."""
    x, target = _batch(args)
    stages = _split(args, x)
    pipes = {
        mode: gpipe.GPipe(
            flow, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint
        )
        for mode, flow in (("direct", stages), ("relayed", stages.relayed()))
    }
    times: dict[str, list[float]] = {mode: [] for mode in pipes}
    sent: dict[str, tuple[int, int]] = {}
    predicted: dict[str, list[float]] = {mode: [] for mode in pipes}
    try:
        for step in range(args.steps + 1):  # the first warms up
            for mode, pipe in pipes.items():
                began = time.perf_counter()
                pipe.train_step(x, target, F.mse_loss)
                elapsed = time.perf_counter() - began
                stages.zero_grad(set_to_none=True)
                if step:
                    times[mode].append(elapsed)
                    predicted[mode].append(pipe.predicted_timeline().makespan)
                transfers = [t for t in pipe.timeline.transfers if t.sender is not None]
                sent[mode] = (
                    sum(t.nbytes for t in transfers if t.kind == "F"),
                    sum(t.nbytes for t in transfers if t.kind == "B"),
                )
    finally:
        for pipe in pipes.values():
            pipe.close()
    ideal_f, ideal_b = ideal_bytes(stages, x, args.chunks)
    out = {
        mode: {
            "ms": statistics.median(times[mode]) * 1e3,
            "predicted_ms": statistics.median(predicted[mode]) * 1e3,
            "forward_mib": sent[mode][0] / 2**20,
            "backward_mib": sent[mode][1] / 2**20,
        }
        for mode in pipes
    }
    out["ideal"] = {"forward_mib": ideal_f / 2**20, "backward_mib": ideal_b / 2**20}
    return out


def torch_pipelining(args: argparse.Namespace) -> float | str:
    """Median seconds per step of torch.distributed.pipelining on the same model, or why not."""
    import gpipe.distributed as gd

    try:
        results = gd.spawn(_theirs, STAGES, args, threads=args.threads)
    except Exception as error:  # a run it cannot do is reported, not fatal
        return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return results[0]


def _theirs(args: argparse.Namespace) -> float:
    import torch.distributed as dist
    from torch.distributed import pipelining

    import gpipe.distributed as gd

    rank, _ = gd.init()
    x, target = _batch(args)
    model = unet(_config(args.width), seed=0)
    split_spec = {point: pipelining.SplitPoint.BEGINNING for point in SPLIT_POINTS}
    pipe = pipelining.pipeline(
        model, mb_args=(x[: args.batch // args.chunks],), split_spec=split_spec
    )
    stage = pipe.build_stage(rank, torch.device("cpu"))
    runner = torch_schedule(stage, args.schedule, args.chunks, F.mse_loss)
    times = []
    for step in range(args.steps + 1):
        dist.barrier()
        began = time.perf_counter()
        run_step(runner, rank == 0, rank == STAGES - 1, x, target)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - began)
        stage.submod.zero_grad()
    return statistics.median(times) if rank == 0 else 0.0


def distributed(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Direct and relayed with one process per stage (DistributedGPipe over gloo)."""
    import gpipe.distributed as gd

    results = gd.spawn(_ours, STAGES, args, threads=args.threads)
    return results[0]


def _ours(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import gpipe.distributed as gd

    rank, _ = gd.init()
    x, target = _batch(args)
    stages = _split(args, x)
    out: dict[str, dict[str, float]] = {}
    if rank == 0:  # NOTE: before a pipe frees the stages this rank does not run
        ideal_f, ideal_b = ideal_bytes(stages, x, args.chunks)
        out["ideal"] = {"forward_mib": ideal_f / 2**20, "backward_mib": ideal_b / 2**20}
    for mode, flow in (("direct", stages), ("relayed", stages.relayed())):
        pipe = gd.DistributedGPipe(
            flow, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint
        )
        times = []
        for step in range(args.steps + 1):
            began = time.perf_counter()
            pipe.train_step(x, target, F.mse_loss)
            if step:
                times.append(time.perf_counter() - began)
            stages.zero_grad(set_to_none=True)
        transfers = [t for t in pipe.timeline.transfers if t.sender is not None]
        out[mode] = {
            "ms": statistics.median(times) * 1e3,
            "predicted_ms": pipe.predicted_timeline().makespan * 1e3,
            "forward_mib": sum(t.nbytes for t in transfers if t.kind == "F") / 2**20,
            "backward_mib": sum(t.nbytes for t in transfers if t.kind == "B") / 2**20,
        }
        pipe.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=64, help="image side (divisible by 16)")
    parser.add_argument("--width", type=int, default=16, help="channels of down.0")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches M")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument(
        "--checkpoint",
        choices=["never", "except_last", "always"],
        default="never",
        help="re-materialization (never: as torch pipelining, which does not recompute)",
    )
    parser.add_argument("--steps", type=int, default=7, help="measured steps (median)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads/process")
    parser.add_argument("--distributed", action="store_true", help="one process per stage")
    parser.add_argument("--no-torch", action="store_true", help="skip torch pipelining")
    parser.add_argument("--quick", action="store_true", help="32x32 images, 3 steps, no torch")
    args = parser.parse_args()
    if args.quick:
        args.side, args.steps, args.no_torch = 32, 3, True
    if args.side % 16 or args.batch % args.chunks:
        parser.error("--side must divide by 16 and --batch by --chunks")

    skip_mib = args.batch // args.chunks * args.width * args.side**2 * 4 / 2**20
    runtime = "distributed (one process per stage)" if args.distributed else "local (threads)"
    print(
        f"U-Net widths {_config(args.width).widths}, {args.side}x{args.side} images, batch "
        f"{args.batch}, K={STAGES}, M={args.chunks}, schedule {args.schedule}, checkpoint "
        f"{args.checkpoint}, {runtime}; down.0's skip is {skip_mib:.2f} MiB per micro-batch"
    )
    results = distributed(args) if args.distributed else local(args)
    ideal = results["ideal"]
    print(f"{'':10} {'fwd MiB':>9} {'bwd MiB':>9} {'step ms':>9} {'simulated ms':>13}")
    for mode in ("direct", "relayed"):
        r = results[mode]
        print(
            f"{mode:10} {r['forward_mib']:9.1f} {r['backward_mib']:9.1f} {r['ms']:9.1f} "
            f"{r['predicted_ms']:13.1f}"
        )
    print(f"{'ideal':10} {ideal['forward_mib']:9.1f} {ideal['backward_mib']:9.1f}")

    theirs: float | str = "skipped"
    if not args.no_torch:
        theirs = torch_pipelining(args)
        if isinstance(theirs, float):
            print(
                f"torch.distributed.pipelining ({args.schedule}, one process per stage): "
                f"{theirs * 1e3:.1f} ms"
            )
        else:
            print(f"torch.distributed.pipelining could not run this model: {theirs}")

    direct, relayed = results["direct"], results["relayed"]
    sent = {
        mode: results[mode]["forward_mib"] + results[mode]["backward_mib"]
        for mode in ("direct", "relayed")
    }
    fields: dict[str, Any] = {
        "runtime": "distributed" if args.distributed else "local",
        "schedule": args.schedule,
        "checkpoint": args.checkpoint,
        "stages": STAGES,
        "microbatches": args.chunks,
        "direct_mib": f"{sent['direct']:.1f}",
        "relayed_mib": f"{sent['relayed']:.1f}",
        "ideal_mib": f"{ideal['forward_mib'] + ideal['backward_mib']:.1f}",
        "bytes_ratio": f"{sent['relayed'] / sent['direct']:.2f}",
        "direct_ms": f"{direct['ms']:.1f}",
        "relayed_ms": f"{relayed['ms']:.1f}",
        "simulated_ms": f"{direct['predicted_ms']:.1f}",
        "time_ratio": f"{relayed['ms'] / direct['ms']:.2f}",
    }
    if isinstance(theirs, float):
        fields["torch_ms"] = f"{theirs * 1e3:.1f}"
        fields["torch_over_direct"] = f"{theirs * 1e3 / direct['ms']:.2f}"
    else:
        fields["torch"] = theirs.split(":")[0].replace(" ", "_")
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
