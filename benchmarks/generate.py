"""Generation through the pipe: tokens/s against HF generate, fill-drain, and the simulator.

Two setups, each on K = 4 stages, one thread per stage, the same greedy prompts throughout:

- gpt2: a random GPT-2 (Hugging Face) cut by ``gpipe.split`` into K stages, real compute.
  Ours (``pipe.generate``, each stage keeping its KV cache) at lanes = 1 and lanes = K,
  against ``model.generate`` on the whole model in this process, and against "the PiPPy
  route": no cache, ``pipe(ids so far)`` in fill-drain over K micro-batches for every new
  token, the last position's argmax appended (what a pipeline without a decode schedule
  runs). On a 2-core host the K stages' threads share two cores, so real compute cannot
  show what lanes gain (K lanes run K times the forwards, each on a quarter of the rows);
  this setup shows what the cache gains and what the pipe costs against the model whole.
- sleep: our GPT (``gpipe.models.gpt``, tiny) with a layer per stage that sleeps a fixed
  time per row it computes, releasing the GIL as a device's kernel does: K stages that
  run at once, like K devices. Lanes = 1 keeps one stage busy at a time; lanes = K keeps
  all of them busy. The sleep is per row and not per position, so a prompt costs what a
  token does, and fill-drain pays its K - 1 fill steps per token but not its recomputing.
  "ideal" is the tokens/s of the sleeps alone, with nothing else: the simulated decode
  schedule, or fill-drain's 2K - 1 micro-batch forwards per token.

Each lane count's run is set against the simulator: the decode schedule
(``gpipe.schedule.decode``) simulated with each stage's mean decode forward in the run
(``pipe.generation_timeline``, prompt forwards left out). "busy" is the devices' busy
fraction, sum of forward times / (K x span), measured on the timeline and simulated. "sim
tok/s" is the simulated steady state (once the pipe is full: the simulated makespan's
growth from T to 2T tokens), and "x sim" the measured tokens/s (wall clock of the whole
``generate`` call, prompt included) over it: what it misses is the fill, the prompt and
every hand-off between threads. Each figure is the median over rounds in which every
variant runs once in turn (noise lands on all alike). Ops run on one torch thread each
(``--threads``), so the stage threads are the only parallelism and HF runs on one core.

    python benchmarks/generate.py          # 32 new tokens, 5 rounds (about 2 minutes)
    python benchmarks/generate.py --quick  # 12 new tokens, 2 rounds

RESULT keys without a prefix are the gpt2 setup's, ``sleep_`` the sleep setup's; ``lanesK``
is lanes = K, ``lanes_gain`` lanes = K over lanes = 1, ``over_filldrain`` lanes = K over
fill-drain, ``same_ids`` whether every run produced the same ids.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from gpipe import GPipe, split
from gpipe.analysis import Costs, Timeline, simulate
from gpipe.models import GPTConfig, delay, gpt
from gpipe.schedule import decode
from host import sleep_overshoot_us

K = 4  # stages, one thread each


class RowSleep(nn.Module):
    """Sleeps ``ms_per_row`` for each row of its input: a device whose forward time grows
    with the rows it computes. It never mixes positions, so ``generate`` may call it on
    the new tokens alone."""

    position_wise = True

    def __init__(self, ms_per_row: float) -> None:
        super().__init__()
        self.seconds_per_row = ms_per_row / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return delay(x, self.seconds_per_row * x.shape[0], 0.0)


@dataclass
class Setup:
    """A model cut into K stages, its prompts, and its logits by one fill-drain ``pipe(...)``."""

    name: str
    pipe: GPipe
    ids: torch.Tensor
    logits: Callable[[torch.Tensor], torch.Tensor]  # [rows, tokens] ids -> logits, no cache
    reference: Callable[[int], torch.Tensor] | None = None  # HF generate, whole model
    ms_per_row: float = 0.0  # the sleep per row of each stage's forward, if any

    def ideal_tok_s(self, run: str, tokens: int) -> float | None:
        """Tokens/s with the sleeps alone and nothing else: the simulated decode schedule,
        or fill-drain's 2K - 1 forwards of a micro-batch per token."""
        if not self.ms_per_row:
            return None
        rows = self.ids.shape[0]
        if run == "fill-drain":
            return rows / ((2 * K - 1) * self.ms_per_row * rows / K / 1e3)
        lanes = int(run.removeprefix("lanes="))
        forward = self.ms_per_row * rows / lanes / 1e3
        timeline = simulate(decode(K, lanes, tokens), Costs(forward=forward, backward=0.0))
        return rows * tokens / timeline.makespan


def gpt2_setup(rows: int, prompt: int) -> Setup:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2048, n_embd=128, n_layer=8, n_head=4, n_positions=256,
                        bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (rows, prompt))
    cuts = [f"transformer.h.{i}" for i in (2, 4, 6)]
    stages = split(model, cuts, example_inputs={"input_ids": ids})
    pipe = GPipe(stages, chunks=K, checkpoint="never")

    def reference(tokens: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    return Setup("gpt2", pipe, ids, lambda x: pipe(input_ids=x).logits, reference)


def sleep_setup(rows: int, prompt: int, ms_per_row: float) -> Setup:
    torch.manual_seed(0)
    config = GPTConfig(vocab=256, context=256, layers=4, heads=2, width=32, dropout=0.0)
    model = gpt(config).eval()
    layers = list(model)  # embedding, 4 blocks, norm, head: one block and a sleep per stage
    staged = [layers[0], layers[1], RowSleep(ms_per_row)]
    for block in layers[2:5]:
        staged += [block, RowSleep(ms_per_row)]
    staged += layers[5:]
    pipe = GPipe(nn.Sequential(*staged), [3, 2, 2, 4], devices=["cpu"] * K, chunks=K,
                 checkpoint="never")  # fmt: skip
    ids = torch.randint(0, config.vocab, (rows, prompt))
    return Setup("sleep", pipe, ids, pipe, ms_per_row=ms_per_row)


@torch.no_grad()
def fill_drain(setup: Setup, tokens: int) -> torch.Tensor:
    """No cache: the whole sequence so far through ``pipe(...)`` for every new token."""
    ids = setup.ids
    for _ in range(tokens):
        ids = torch.cat([ids, setup.logits(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@dataclass
class AgainstSimulation:
    """One ``generate`` run's timeline set against the simulated decode schedule."""

    busy_measured: float  # sum of forward times / (K x span), on the measured timeline
    busy_simulated: float  # the same, simulated with the run's per-stage mean forwards
    round_s: float  # simulated steady state: seconds per token of every lane


def against_simulation(timeline: Timeline, lanes: int, tokens: int) -> AgainstSimulation:
    """The decode schedule simulated with each stage's mean decode forward in the run (its
    prompt forwards left out), beside what the run measured.

    NOTE: means, not the medians ``costs_from_timeline`` gives: a run's time is the sum of
    its forwards, and on a loaded host the few that a preempted thread stretched are paid
    as surely as the others.
    """
    forward = [
        statistics.fmean(e.duration for e in device if e.microbatch >= lanes)
        for device in timeline.events
    ]
    costs = Costs(forward=forward, backward=0.0, activation_bytes=0)
    whole = simulate(decode(K, lanes, tokens), costs)
    longer = simulate(decode(K, lanes, 2 * tokens), costs)
    round_s = (longer.makespan - whole.makespan) / tokens
    return AgainstSimulation(1 - timeline.bubble, 1 - whole.bubble, round_s)


@dataclass
class Measured:
    """One variant's runs: seconds per call, and for ``generate`` each run's simulation."""

    seconds: list[float] = field(default_factory=list)
    simulated: list[AgainstSimulation] = field(default_factory=list)

    def tokens_per_s(self, rows: int, tokens: int) -> float:
        return rows * tokens / statistics.median(self.seconds)

    def median(self, name: str) -> float:
        return statistics.median(getattr(s, name) for s in self.simulated)


def measure(setup: Setup, tokens: int, rounds: int) -> tuple[dict[str, Measured], bool]:
    """Each variant's runs, in turns over ``rounds`` rounds after a warm-up one, and
    whether every variant produced the same ids."""
    pipe, ids = setup.pipe, setup.ids
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    if setup.reference is not None:
        runs["hf"] = partial(setup.reference, tokens)
    for lanes in (1, K):
        runs[f"lanes={lanes}"] = partial(pipe.generate, ids, max_new_tokens=tokens, lanes=lanes)
    runs["fill-drain"] = partial(fill_drain, setup, tokens)
    found = {name: Measured() for name in runs}
    outputs: dict[str, torch.Tensor] = {}
    for turn in range(rounds + 1):
        for name, run in runs.items():
            began = time.perf_counter()
            outputs[name] = run()
            elapsed = time.perf_counter() - began
            if turn == 0:  # warm-up
                continue
            found[name].seconds.append(elapsed)
            if name.startswith("lanes="):
                lanes = int(name.removeprefix("lanes="))
                timeline = pipe.generation_timeline
                found[name].simulated.append(against_simulation(timeline, lanes, tokens))
    first = next(iter(outputs.values()))
    return found, all(torch.equal(out, first) for out in outputs.values())


def report(setup: Setup, tokens: int, rounds: int) -> dict[str, str]:
    """Print the setup's rows of the table; its RESULT fields."""
    found, same = measure(setup, tokens, rounds)
    rows = setup.ids.shape[0]
    rate = {name: m.tokens_per_s(rows, tokens) for name, m in found.items()}
    prefix = "" if setup.name == "gpt2" else f"{setup.name}_"
    fields: dict[str, str] = {}
    for name, m in found.items():
        key = name.replace("lanes=", "lanes").replace(f"lanes{K}", "lanesK").replace("-", "")
        fields[f"{prefix}{key}_tok_s"] = f"{rate[name]:.1f}"
        hf = f"{rate[name] / rate['hf']:7.3f}" if "hf" in rate else f"{'-':>7}"
        ideal = setup.ideal_tok_s(name, tokens)
        line = (
            f"{setup.name:>6} {name:>10} {rate[name]:9.1f} {hf} "
            f"{rate[name] / rate['lanes=1']:9.3f} "
            + (f"{ideal:9.1f}" if ideal is not None else f"{'-':>9}")
        )
        if ideal is not None:
            fields[f"{prefix}{key}_ideal_tok_s"] = f"{ideal:.1f}"
        if m.simulated:
            sim_rate = rows / m.median("round_s")
            busy, busy_sim = m.median("busy_measured"), m.median("busy_simulated")
            line += f" {busy:10.3f} {busy_sim:9.3f} {sim_rate:9.1f} {rate[name] / sim_rate:6.3f}"
            if name == f"lanes={K}":
                fields[f"{prefix}busy_measured"] = f"{busy:.3f}"
                fields[f"{prefix}busy_simulated"] = f"{busy_sim:.3f}"
                fields[f"{prefix}sim_steady_tok_s"] = f"{sim_rate:.1f}"
            fields[f"{prefix}{key}_over_sim"] = f"{rate[name] / sim_rate:.3f}"
        print(line)
    if "hf" in rate:
        fields["lanes1_over_hf"] = f"{rate['lanes=1'] / rate['hf']:.3f}"
    fields[f"{prefix}over_filldrain"] = f"{rate[f'lanes={K}'] / rate['fill-drain']:.3f}"
    fields[f"{prefix}lanes_gain"] = f"{rate[f'lanes={K}'] / rate['lanes=1']:.3f}"
    fields[f"{prefix}same_ids"] = str(int(same))
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per row")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ms-per-row", type=float, default=6.0, help="the sleep setup's")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="12 new tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.rounds = 12, 2
    # NOTE: one thread per op, so the K stage threads are the only parallelism; with two
    # per op, four stage threads on two cores wait on each other's OpenMP barriers.
    torch.set_num_threads(args.threads)
    overshoot = sleep_overshoot_us(args.ms_per_row * 1e-3, repeats=30)
    print(f"K={K} stages, {args.rows} rows, prompts of {args.prompt} tokens, {args.tokens} new "
          f"tokens each, greedy; medians of {args.rounds} rounds; torch threads "
          f"{args.threads}; time.sleep({args.ms_per_row:g} ms) overshoots by "
          f"{overshoot:.0f} us here")  # fmt: skip
    print(f"{'setup':>6} {'run':>10} {'tok/s':>9} {'x hf':>7} {'x lanes=1':>9} {'ideal':>9} "
          f"{'busy meas':>10} {'busy sim':>9} {'sim tok/s':>9} {'x sim':>6}")  # fmt: skip
    fields: dict[str, str] = {"stages": str(K), "rows": str(args.rows), "tokens": str(args.tokens)}
    fields |= report(gpt2_setup(args.rows, args.prompt), args.tokens, args.rounds)
    fields |= report(sleep_setup(args.rows, args.prompt, args.ms_per_row), args.tokens, args.rounds)
    print("RESULT " + " ".join(f"{key}={value}" for key, value in fields.items()))


if __name__ == "__main__":
    main()
