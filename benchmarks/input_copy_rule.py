"""What the in-place rule costs a model that writes into no stage input: about nothing.

A stage whose forward writes into its input gets a copy of it (see gpipe.runtime.input_writes); to
know which stages do, every forward reads its input's version counter before and after, and
each stage's first forward (per mode) runs on a copy. This runs the same tiny GPT steps with
the rule as it is and with it patched away (no copy, no version reads), interleaved, and
compares the process CPU time per step (one intra-op thread, so other load on a shared machine
moves it less than wall-clock time). It also times the version check alone. There is no
torch.distributed.pipelining counterpart: this measures one rule, not the pipeline.

    python benchmarks/input_copy_rule.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpipe import GPipe
from gpipe.models import GPTConfig, gpt, gpt_loss, synthetic_tokens
from gpipe.runtime import forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = GPTConfig()
    torch.manual_seed(0)
    ids, targets = synthetic_tokens(64, config)
    versions, copy = forward.versions, forward.cloned

    def rule(on: bool) -> None:
        forward.versions = versions if on else (lambda value: None)  # type: ignore[assignment]
        forward.cloned = copy if on else (lambda value: value)  # type: ignore[assignment]

    fields: dict[str, str] = {}
    for stages, checkpoint in [(1, "never"), (4, "except_last")]:
        model = gpt(config)
        pipe = GPipe(
            model,
            [len(model)] if stages == 1 else None,
            devices=["cpu"] * stages,
            chunks=8,
            checkpoint=checkpoint,
        )
        pipe.train_step(ids, targets, gpt_loss)  # warm-up; learns that no stage writes
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.steps):
            for on in (True, False):
                rule(on)
                model.zero_grad()
                began = time.process_time()
                pipe.train_step(ids, targets, gpt_loss)
                times[on].append(time.process_time() - began)
        rule(True)
        with_ms, without_ms = (statistics.median(times[on]) * 1e3 for on in (True, False))
        print(
            f"{stages} stage(s), checkpoint={checkpoint}, 8 micro-batches: {with_ms:.2f} ms CPU "
            f"per step with the rule, {without_ms:.2f} ms without ({with_ms / without_ms:.3f}x)"
        )
        fields[f"k{stages}_with_ms"] = f"{with_ms:.2f}"
        fields[f"k{stages}_without_ms"] = f"{without_ms:.2f}"
        fields[f"k{stages}_ratio"] = f"{with_ms / without_ms:.4f}"

    x = torch.randn(8, 64, 128)
    n = 100_000
    began = time.perf_counter()
    for _ in range(n):
        before = versions(x)
        _ = versions(x) != before
    check_us = (time.perf_counter() - began) / n * 1e6
    print(f"the version check of one forward (a lone input tensor): {check_us:.2f} us")
    fields["check_us"] = f"{check_us:.2f}"
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
