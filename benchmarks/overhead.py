"""The runtime's own cost: one stage with chunks=M vs plain gradient accumulation.

Both run the same tiny GPT over the same M micro-batches, forward and backward, without
re-materialization; the ratio is what the pipeline machinery (worker thread, messages,
random streams, memory accounting) adds. torch.distributed.pipelining runs the same one-stage
job in its own process for comparison. The pipe runs twice: as it comes (counting the bytes
each micro-batch keeps for the timeline, a hook on every saved tensor) and with
``track_memory=False``.

    python benchmarks/overhead.py [--microbatches 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_reference
from gpipe import GPipe, scatter
from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    args = parser.parse_args()
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

    runs = {
        "plain": plain,
        "gpipe": lambda: pipe.train_step(ids, targets, gpt_loss),
        "untracked": lambda: lean.train_step(ids, targets, gpt_loss),
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
    print(f"plain gradient accumulation: {plain_ms:.2f} ms   gpipe, 1 stage: {gpipe_ms:.2f} ms"
          f"   the same with track_memory=False: {lean_ms:.2f} ms")  # fmt: skip
    fields = {
        "microbatches": m,
        "plain_ms": f"{plain_ms:.2f}",
        "gpipe_ms": f"{gpipe_ms:.2f}",
        "ratio": f"{gpipe_ms / plain_ms:.3f}",
        "untracked_ms": f"{lean_ms:.2f}",
        "ratio_untracked": f"{lean_ms / plain_ms:.3f}",
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
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
