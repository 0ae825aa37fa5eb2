"""Train a tiny GPT with a 4-stage, 8-micro-batch pipeline on synthetic data and show it."""

from __future__ import annotations

import argparse
import os
import time

from gpipe.analysis import BUBBLE_FORMULAS, bubble_formula
from gpipe.checkpoint import CHECKPOINT_MODES
from gpipe.cli.arguments import CommandError, positive_int, seed
from gpipe.schedule import SCHEDULES

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options; the defaults need nothing but a CPU."""
    parser.add_argument(
        "--stages", type=positive_int, default=4, help="pipeline stages (default 4)"
    )
    parser.add_argument(
        "--microbatches", type=positive_int, default=8, help="micro-batches (default 8)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=30, help="training steps (default 30)"
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=64,
        help="mini-batch size, at least one sample per micro-batch (default 64)",
    )
    parser.add_argument(
        "--schedule", default="gpipe", choices=sorted(SCHEDULES), help="schedule for train_step"
    )
    parser.add_argument("--checkpoint", default="except_last", choices=CHECKPOINT_MODES)
    parser.add_argument("--plot", metavar="PNG", help="also draw the last step's timeline")
    parser.add_argument("--seed", type=seed, default=0)


def run(args: argparse.Namespace) -> int:
    """Train, print the loss as it falls, then the last step's timeline and its bubble.

    Raises:
        CommandError: more stages than the model has layers, fewer samples than
            micro-batches, a schedule that cannot run this pipeline, or a plot that cannot
            be written.
    """
    k, m = args.stages, args.microbatches
    if args.plot and os.path.isdir(args.plot):
        raise CommandError(f"--plot {args.plot} is a folder: give a file name, e.g. step.png")
    if args.batch < m:
        # NOTE: the pipe would run one micro-batch per sample, fewer than asked for, and
        # the bubble printed beside the formula for M would not be the run's.
        raise CommandError(
            f"--batch {args.batch} cannot make {m} micro-batches of at least one sample: "
            f"use --batch >= {m} or --microbatches <= {args.batch}"
        )
    import torch
    from tqdm import tqdm

    from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens
    from gpipe.pipe import GPipe

    torch.manual_seed(args.seed)
    # NOTE: one intra-op thread per stage worker: the workers are the parallelism, and more
    # threads than cores would make every stage slower.
    torch.set_num_threads(1)
    config = GPTConfig()
    model = gpt(config)
    if k > len(model):
        raise CommandError(f"the tiny GPT has {len(model)} layers: use --stages <= {len(model)}")
    try:
        pipe = GPipe(
            model,
            devices=["cpu"] * k,
            chunks=m,
            checkpoint=args.checkpoint,
            schedule=args.schedule,
        )
    except ValueError as error:  # e.g. a schedule that cannot run K stages and M micro-batches
        raise CommandError(str(error)) from None
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(args.seed)
    print(
        f"tiny GPT, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(model)} layers -> balance {pipe.balance} on {k} stages, {m} micro-batches, "
        f"schedule {args.schedule}, checkpoint {args.checkpoint}"
    )
    first = last = float("nan")
    start = time.perf_counter()
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for step in bar:
            ids, targets = synthetic_tokens(args.batch, config, generator=data)
            optimizer.zero_grad()
            loss = pipe.train_step(ids, targets, gpt_loss).item()
            optimizer.step()
            first = loss if step == 0 else first
            last = loss
            bar.set_postfix(loss=f"{loss:.3f}")
    seconds = time.perf_counter() - start
    timeline = pipe.timeline
    print(timeline)
    formula = bubble_formula(args.schedule, k, m, 1)
    shown = "none known" if formula is None else f"{formula:.3f}"
    recorded = "none" if formula is None else f"{formula:.4f}"
    print(f"loss {first:.3f} -> {last:.3f} in {args.steps} steps ({seconds:.1f} s)")
    predicted = pipe.predicted_timeline()
    print(
        f"bubble: measured {timeline.bubble:.3f}, {args.schedule} formula "
        f"{BUBBLE_FORMULAS[args.schedule]} = {shown}, "
        f"simulated with this step's measured stage costs {predicted.bubble:.3f}"
    )
    cores = os.cpu_count() or 1
    if cores < k:
        print(
            f"(the {k} stages share {cores} CPU cores here, so stages slow each "
            "other down; on one device per stage they would not)"
        )
    if args.plot:
        try:
            drawn = timeline.plot(args.plot, compare=predicted)
        except OSError as error:
            raise CommandError(f"cannot write --plot {args.plot}: {error.strerror}") from None
        print(f"timeline drawn to {drawn}")
    print(
        f"RESULT stages={k} microbatches={m} first_loss={first:.4f} last_loss={last:.4f} "
        f"bubble={timeline.bubble:.4f} bubble_formula={recorded} seconds={seconds:.2f}"
    )
    return 0
