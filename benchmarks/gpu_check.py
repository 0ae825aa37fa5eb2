"""The GPU check: CUDA tests, parity and speed on one GPU, in one command and one report.

    make gpu-check                                   # or, with nothing installed:
    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out benchmarks/runs/gpu_check.txt]
    PYTHONPATH=src python3 benchmarks/gpu_check.py --smoke    # tiny sizes; on CPU if no GPU

Without CUDA it says so and writes no report unless ``--out`` names a file: the saved
``benchmarks/runs/gpu_check.txt`` is a GPU's, and the docs cite its figures. Its exit code
is 0 then (1 only when a section fails).

Imports only torch, the standard library and gpipe (pytest for the tests section, if the
machine has it). Each section runs in a process of its own under a timeout, so a hang (the
section's stacks are dumped by faulthandler and it exits) or a crash costs that section
alone; a hung case is reported as HUNG and the section goes on from the next case. The
whole check keeps within ``--budget`` seconds (default 300).

Sections:

- tests: ``tests/test_cuda.py`` under pytest.
- parity (and backward, run last): every schedule's ``train_step``, and ``pipe(x)`` then
  ``.backward()``, against plain training of the same layers on the same devices and
  micro-batches, in float64 and under bf16 autocast; all stages on cuda:0, and mixed
  ``["cpu", "cuda:0"]`` (and the reverse for the fill-drain backward). Every hand-off is
  64 MiB, so a copy read before it lands (a missed event) shows as a wrong answer, not as
  round-off.
- speed: a GPT-2-small-sized model (12 layers, d=768, vocab 50304, T=512, batch 16) on 4
  devices of one GPU (8 stages for the schedules of two stages per device) at M=8 = 2K
  (the fewest DualPipeV runs), every schedule against plain training of the same
  micro-batches: step time medians, peak CUDA memory, CPU time, the runtime's cost per
  action beyond plain, and the GPU's busy fraction from torch.profiler's kernels.
  ``1f1b+threads`` runs the 4 stages on a thread each, as before the stages of one GPU
  shared one thread (a lane), to show what the lane saves. The fused pair: what
  DualPipeV's fused action (a forward on a side stream while another micro-batch's full
  backward runs on the current one, as ``StageWorker._fused`` issues it) takes against
  its parts one after the other, the ``Costs.fused`` this GPU gives: measured as
  DualPipeV's step against the same step with each pair split back into its parts, as
  ``Costs.from_timeline`` reads it off the step, and on one stage alone.
- torch: torch.distributed.pipelining's single-process schedules (every stage on this
  rank) on the same model, as a reference.
- overhead: the runtime's CPU cost per action (``benchmarks/overhead.py``'s fit at K=4),
  beside bare Python threads, on this host's cores.
- plan: the planner's predicted peak memory against the CUDA allocator's after a real step
  (Adam's state in place), and the headroom ``Plan.calibrate`` makes of them.
- generate (after backward, so that it takes no time from the others): ``pipe.generate``
  on a GPT-2-small config (random init, 12 layers, d=768) split into 4 stages on one GPU,
  8 prompt rows of 32 tokens, 128 new tokens, greedy, at 1 lane and at 8 lanes, against
  Hugging Face's ``model.generate`` on the same model and GPU: tokens/s and their ratio.
  Needs ``transformers`` (skipped without it).

The report's last line is ``RESULT key=value ...``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SAVED = ROOT / "benchmarks" / "runs" / "gpu_check.txt"  # the GPU's report that the docs cite
SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "interleaved-zb",
    "looped-bfs",
    "v-half",
    "v-min",
    "dualpipev",
)
# A case's own timeout, seconds, inside its section's process (the first case of a
# section also pays CUDA's start-up).
_CASE_TIMEOUT = {
    "parity": 25.0,
    "speed": 90.0,
    "torch": 30.0,
    "overhead": 60.0,
    "plan": 60.0,
    "backward": 15.0,
    "generate": 120.0,
}
_SECTION_TIMEOUT = {
    "tests": 60.0,
    "parity": 130.0,
    "speed": 180.0,
    "torch": 35.0,
    "overhead": 70.0,
    "plan": 70.0,
    "backward": 60.0,
    "generate": 150.0,
}


# -- the parts each section runs (in its own process) ----------------------------------


def _device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _virtual(schedule: str) -> int:
    """Model stages per device: 2 for the looped and V schedules, else 1."""
    from gpipe.schedule import default_virtual_stages

    return default_virtual_stages(schedule)


def _chunks(schedule: str, devices: int, least: int) -> int:
    """At least ``least`` micro-batches, and the 2K that DualPipeV needs."""
    return max(least, 2 * devices) if schedule == "dualpipev" else least


def _balance(layers: int, stages: int) -> list[int]:
    """``layers`` modules in ``stages`` consecutive stages, the larger ones first."""
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def _split_pairs(schedule: Any) -> Any:
    """``schedule`` with every fused action replaced by its parts, in order: the same work
    in the same order, without the overlap a pair allows."""
    from gpipe.schedule import Schedule

    actions = [[unit for action in device for unit in action.units] for device in schedule.actions]
    return Schedule(f"{schedule.name}-split", actions, schedule.microbatches, schedule.stages,
                    schedule.placement)  # fmt: skip


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _parity_model(layers: int, width: int, dtype: Any) -> Any:
    """``layers`` blocks of 3 modules: to float32 on a CPU, Linear, Tanh."""
    import torch
    from torch import nn

    class CpuFloat(nn.Module):
        """bf16 (from a GPU stage under autocast) to float32 on a CPU, which has none."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float() if x.dtype == torch.bfloat16 and not x.is_cuda else x

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [CpuFloat(), nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks).to(dtype)


def _parity_cases(mode: str) -> list[tuple[str, tuple[str, ...], str, str]]:
    """(mode, devices, dtype, schedule) of each parity case of ``mode``.

    ``pipe(x).backward()`` always runs GPipe's fill-drain, so one schedule; and it has a
    section of its own, run last: it is the one that hung.
    """
    gpu = _device()
    layouts = [(gpu,) * 4, ("cpu", gpu)]
    if mode == "backward":
        layouts.append((gpu, "cpu"))
    return [
        (mode, devices, dtype, schedule)
        for dtype in ("float64", "bf16")
        for devices in layouts
        for schedule in (SCHEDULES if mode == "train_step" else ("gpipe",))
    ]


def _parity_case(mode: str, devices: tuple[str, ...], dtype_name: str, schedule: str,
                 smoke: bool) -> str:  # fmt: skip
    """Run one parity case; its verdict line ("ok ..." or "FAIL ...")."""
    import torch
    from torch.nn import functional as F

    from gpipe import GPipe

    m = _chunks(schedule, len(devices), 4)
    width = 16 if smoke else 256
    # NOTE: 32768 rows x 256 float64 = 64 MiB per micro-batch hand-off (32 MiB in fp32)
    rows = 8 if smoke else 32768
    virtual = _virtual(schedule)
    stages = len(devices) * virtual
    layers = max(stages, 4)
    dtype = torch.float64 if dtype_name == "float64" else torch.float32
    model = _parity_model(layers, width, dtype)
    per = 3 * layers // stages
    balance = [per] * stages
    balance[-1] += 3 * layers - per * stages
    pipe = GPipe(model, balance, devices=list(devices), chunks=m, schedule=schedule,
                 virtual_stages=virtual)  # fmt: skip
    torch.manual_seed(1)  # NOTE: drawn on the GPU: 512 MiB of randn takes a CPU seconds
    x = torch.randn(m * rows, width, dtype=dtype, device=_device())
    target = torch.randn(m * rows, width, dtype=dtype, device=_device())
    stage_devices = [next(p.parameters()).device for p in pipe.partitions]
    # NOTE: the V schedules end on the first device: the target goes where the last stage is
    x, target = x.to(stage_devices[0]), target.to(stage_devices[-1])
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dtype_name == "bf16" and torch.cuda.is_available()
        else torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "bf16")
    )
    order = sorted(range(len(pipe.partitions)), key=lambda s: s)

    def plain() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Plain training: micro-batch by micro-batch through the same layers, no pipe."""
        given = x.detach().requires_grad_(mode == "backward")
        outputs, total = [], torch.zeros((), dtype=torch.float64)
        for xi, ti in zip(given.chunk(m), target.chunk(m)):
            with autocast:
                h = xi
                for s in order:
                    h = pipe.partitions[s](h.to(stage_devices[s]))
                loss = F.mse_loss(h.to(ti.device), ti) * (xi.shape[0] / given.shape[0])
            loss.backward()
            outputs.append(h.detach())
            total += loss.detach().double().cpu()
        return torch.cat(outputs), given.grad, total

    def piped() -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        given = x.detach().requires_grad_(mode == "backward")
        with autocast:
            if mode == "train_step":
                loss = pipe.train_step(given, target, F.mse_loss)
                return None, None, loss.double().cpu()
            y = pipe(given)
            loss = F.mse_loss(y.to(target.device), target)
        loss.backward()
        return y.detach(), given.grad, loss.detach().double().cpu()

    params = list(model.parameters())
    expected_y, expected_dx, expected_loss = plain()
    expected = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    _sync()
    began = time.perf_counter()
    y, dx, loss = piped()
    _sync()
    seconds = time.perf_counter() - began
    pairs = [(p.grad, e) for p, e in zip(params, expected)]
    if y is not None:
        pairs.append((y, expected_y))
    if dx is not None:
        pairs.append((dx, expected_dx))
    worst = 0.0
    for got, want in pairs:
        if got is None:
            return f"FAIL missing gradient ({seconds:.2f} s)"
        got, want = got.double().cpu(), want.double().cpu()
        scale = want.abs().max().item() or 1.0
        worst = max(worst, (got - want).abs().max().item() / scale)
    loss_error = abs(loss.item() - expected_loss.item()) / (abs(expected_loss.item()) or 1.0)
    worst = max(worst, loss_error)
    tolerance = 1e-9 if dtype_name == "float64" else 2e-2
    pipe.close()
    verdict = "ok" if worst <= tolerance and worst == worst else "FAIL"
    return f"{verdict} rel_err={worst:.1e} (tol {tolerance:.0e}) {seconds:.2f} s"


def section_parity(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    for mode, devices, dtype, schedule in _parity_cases(
        "backward" if args.section == "backward" else "train_step"
    ):
        name = f"parity {mode} {dtype} {'+'.join(devices)} {schedule}"
        yield name, lambda a=(mode, devices, dtype, schedule): _parity_case(*a, args.smoke)


def _gpt(smoke: bool) -> tuple[Any, Any, Any, list[int], int]:
    """The speed model on the GPU, a batch of ids and targets, the 4-stage balance, M."""
    import torch

    from gpipe.models import GPTConfig, gpt

    if smoke:  # NOTE: 6 blocks make 9 modules, enough for 8 stages
        config = GPTConfig(vocab=64, context=16, layers=6, heads=2, width=16, dropout=0.0)
        batch = 8
    else:
        config = GPTConfig(vocab=50304, context=512, layers=12, heads=12, width=768, dropout=0.0)
        batch = 16
    torch.manual_seed(0)
    model = gpt(config).to(_device())
    ids = torch.randint(0, config.vocab, (batch, config.context), device=_device())
    targets = torch.randint(0, config.vocab, (batch, config.context), device=_device())
    # embedding + L blocks + norm + head: [4, 4, 4, 3] at full size, the head last
    n = len(model)
    return model, ids, targets, _balance(n, 4), 8


def _busy_fraction(run: Callable[[], None]) -> str:
    """The share of one step's wall time the GPU ran kernels or copies (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "n/a"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _sync()
        began = time.perf_counter_ns()
        run()
        _sync()
        wall_us = (time.perf_counter_ns() - began) / 1e3
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((event.time_range.start, event.time_range.end))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the intervals: streams may overlap
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return f"{busy / wall_us:.3f}"


def _fused_pair(stage: Any, hidden: Any, repeats: int) -> tuple[float, float]:
    """Median seconds of one fused pair on ``stage``, and of its parts one after the other.

    The pair is what ``StageWorker._fused`` issues on a GPU: the forward of one micro-batch
    on a side stream (which first waits for the current one) while the full backward (input
    and weight gradients) of another runs on the current stream, which then waits for the
    side one. Apart: the same forward, then the same backward, on the current stream. Each
    is timed by CUDA events on the current stream (on a CPU, by the clock; there a pair's
    parts run one after the other anyway). The backward's graph is built before the clock
    starts, as in a step, where its forward ran long before.
    """
    import torch

    cuda = hidden.is_cuda
    if cuda:
        current = torch.cuda.current_stream(hidden.device)
        side = torch.cuda.Stream(hidden.device)

    def once(fused: bool) -> float:
        given = hidden.detach().requires_grad_()
        output = stage(given)  # the other micro-batch's forward, whose backward is timed
        gradient = torch.ones_like(output)
        _sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        x = hidden.detach().requires_grad_()  # NOTE: kept for a backward, as in a step
        if fused and cuda:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                y = stage(x)
            torch.autograd.backward(output, gradient)
            current.wait_stream(side)
        else:
            y = stage(x)
            torch.autograd.backward(output, gradient)
        if cuda:
            end.record()
        _sync()
        seconds = start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - began
        del y
        return seconds

    for _ in range(3):  # warm-up: kernels chosen, memory cached
        once(True)
        once(False)
    pairs, apart = [], []
    for _ in range(repeats):  # in turns: noise lands on both alike
        pairs.append(once(True))
        apart.append(once(False))
    return statistics.median(pairs), statistics.median(apart)


def section_speed(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    import torch

    from gpipe import GPipe, scatter
    from gpipe.models import gpt_loss
    from gpipe.schedule import make_schedule

    model, ids, targets, balance, m = _gpt(args.smoke)
    gpu = _device()

    def pipe_of(schedule: Any, checkpoint: str = "never") -> Any:
        v = _virtual(schedule) if isinstance(schedule, str) else schedule.virtual_stages
        stages = balance if v == 1 else _balance(len(model), 4 * v)
        return GPipe(model, stages, devices=[gpu] * 4, chunks=m, schedule=schedule,
                     checkpoint=checkpoint, virtual_stages=v)  # fmt: skip

    pipes = {name: pipe_of(name) for name in SCHEDULES}
    pipes["1f1b+ckpt"] = pipe_of("1f1b", "except_last")
    # NOTE: as before lanes, a thread per stage on the one GPU: what a lane saves, measured
    threads = pipe_of("1f1b")
    threads._stages.lanes = [[d] for d in range(4)]
    pipes["1f1b+threads"] = threads
    runs: dict[str, Callable[[], None]] = {}

    def plain() -> None:
        for x, t in zip(scatter(ids, m), scatter(targets, m)):
            (gpt_loss(model(x), t) * (x.shape[0] / ids.shape[0])).backward()

    runs["plain"] = plain
    for name, pipe in pipes.items():
        runs[name] = lambda pipe=pipe: pipe.train_step(ids, targets, gpt_loss)
    actions = {}  # F, B and W actions per step (a fused action counts its parts)
    for name in pipes:
        schedule = name.split("+")[0]
        built = make_schedule(schedule, 4, m, virtual_stages=_virtual(schedule))
        actions[name] = sum(len(action.units) for device in built.actions for action in device)
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    peak: dict[str, int] = {}

    def measure() -> str:
        for run in runs.values():  # warm-up: kernels chosen, memory cached
            run()
            model.zero_grad(set_to_none=True)
        for _ in range(3 if args.smoke else 8):  # interleaved: noise lands on all alike
            for name, run in runs.items():
                _sync()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                began, began_cpu = time.perf_counter(), time.process_time()
                run()
                _sync()
                wall[name].append(time.perf_counter() - began)
                cpu[name].append(time.process_time() - began_cpu)
                if torch.cuda.is_available():
                    peak[name] = torch.cuda.max_memory_allocated()
                model.zero_grad(set_to_none=True)
        plain_ms = statistics.median(wall["plain"]) * 1e3
        plain_cpu = statistics.median(cpu["plain"]) * 1e3
        steps = len(wall["plain"])
        lines = [f"M={m}, K=4 devices on {gpu}, balance {balance} (8 stages: "
                 f"{_balance(len(model), 8)}); medians of {steps} steps"]  # fmt: skip
        lines.append(
            "  (us/action: beyond plain, per F/B/W action; wall = step time, cpu = CPU time of "
            "every thread)"
        )
        lines.append(f"  {'run':<14} {'step ms':>9} {'x plain':>8} {'cpu ms':>8} "
                     f"{'wall us/a':>10} {'cpu us/a':>9} {'peak MiB':>9}")  # fmt: skip
        for name in runs:
            ms = statistics.median(wall[name]) * 1e3
            cpu_ms = statistics.median(cpu[name]) * 1e3
            key = name.replace("-", "_").replace("+", "_")
            per_action = " " * 20
            if name in actions:
                wall_us = (ms - plain_ms) * 1e3 / actions[name]
                cpu_us = (cpu_ms - plain_cpu) * 1e3 / actions[name]
                per_action = f"{wall_us:10.1f} {cpu_us:9.1f}"
                _result(f"speed_{key}_cpu_us_per_action", f"{cpu_us:.0f}")
            lines.append(
                f"  {name:<14} {ms:9.1f} {ms / plain_ms:8.3f} {cpu_ms:8.1f} {per_action} "
                f"{peak.get(name, 0) / 2**20:9.0f}"
            )
            _result(f"speed_{key}_ms", f"{ms:.1f}")
            if name != "plain":
                _result(f"speed_{key}_ratio", f"{ms / plain_ms:.3f}")
        _result("speed_plain_cpu_ms", f"{plain_cpu:.1f}")
        return "\n".join(lines)

    yield "speed step times", measure

    def busy() -> str:
        found = {name: _busy_fraction(runs[name]) for name in ("plain", "gpipe", "1f1b")}
        for name, value in found.items():
            _result(f"busy_{name}", value)
        return "GPU busy fraction of one step: " + ", ".join(f"{k} {v}" for k, v in found.items())

    yield "speed GPU busy", busy

    def memory() -> str:
        lines = ["peak MiB, the stages' own count (timeline) vs the CUDA allocator's:"]
        for name, pipe in pipes.items():
            runs[name]()
            ours = max(e.memory for device in pipe.timeline.events for e in device)
            allocated = sum(pipe.cuda_memory.values())
            lines.append(f"  {name:<14} {ours / 2**20:9.0f} {allocated / 2**20:9.0f}")
            model.zero_grad(set_to_none=True)
        return "\n".join(lines)

    yield "speed memory", memory

    def timeline() -> str:
        pipe = pipes["1f1b"]
        runs["1f1b"]()
        _sync()
        events = [e for device in pipe.timeline.events for e in device]
        span = max(e.end for e in events) - min(e.start for e in events)
        busy = sum(e.end - e.start for e in events)
        return (
            f"1f1b timeline: {len(events)} actions, span {span * 1e3:.1f} ms, "
            f"sum of action times {busy * 1e3:.1f} ms"
        )

    yield "speed timeline", timeline

    def fused_pair() -> str:
        from gpipe.analysis import Costs

        fused_pipe = pipes["dualpipev"]
        split_pipe = pipe_of(_split_pairs(make_schedule("dualpipev", 4, m, virtual_stages=2)))
        turns = {"fused": fused_pipe, "split": split_pipe}
        times: dict[str, list[float]] = {name: [] for name in turns}
        for turn in range(1 + (3 if args.smoke else 8)):  # the first: warm-up
            for name, pipe in turns.items():
                _sync()
                began = time.perf_counter()
                pipe.train_step(ids, targets, gpt_loss)
                _sync()
                if turn:
                    times[name].append(time.perf_counter() - began)
                model.zero_grad(set_to_none=True)
        fused_ms, split_ms = (statistics.median(times[name]) * 1e3 for name in turns)
        # the step the fused pipe ran last: its pairs against its own plain F, B and W
        from_step = Costs.from_timeline(fused_pipe.timeline, 8).fused
        stage = fused_pipe.partitions[1]  # two GPT blocks (one at --smoke)
        with torch.no_grad():
            hidden = fused_pipe.partitions[0](scatter(ids, m)[0])
        pair, apart = _fused_pair(stage, hidden, 5 if args.smoke else 30)
        model.zero_grad(set_to_none=True)
        split_pipe.close()
        _result("fused_step_ms", f"{fused_ms:.1f}")
        _result("fused_split_step_ms", f"{split_ms:.1f}")
        _result("fused_step_ratio", f"{fused_ms / split_ms:.3f}")
        _result("fused_from_timeline", f"{from_step:.3f}")
        _result("fused_stage_ratio", f"{pair / apart:.3f}")
        return "\n".join([
            f"fused pair (Costs.fused), dualpipev, K=4, M={m} on {gpu}:",
            f"  step: {fused_ms:.1f} ms with its pairs fused, {split_ms:.1f} ms with each "
            f"split into its parts in order: {fused_ms / split_ms:.3f}",
            f"  Costs.from_timeline of the fused step: a pair takes {from_step:.3f} of its "
            "parts' median F + B + W",
            f"  one stage: F of one micro-batch with the full backward of another "
            f"{pair * 1e3:.2f} ms fused, {apart * 1e3:.2f} ms one after the other: "
            f"{pair / apart:.3f}",
        ])  # fmt: skip

    yield "speed fused pair", fused_pair


def section_torch(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from gpipe import scatter
    from gpipe.models import gpt_loss

    def measure() -> str:
        from torch.distributed import pipelining

        model, ids, targets, balance, m = _gpt(args.smoke)
        gpu = torch.device(_device())
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if gpu.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        layers = list(model)
        parts = []
        for s in range(4):
            start = sum(balance[:s])
            parts.append(nn.Sequential(*layers[start : start + balance[s]]))
        mb_ids = scatter(ids, m)[0]
        shapes = [mb_ids]  # NOTE: a stage's input needs a gradient iff its example's does
        for part in parts:
            shapes.append(part(shapes[-1]).detach().requires_grad_())

        def schedule(kind: str) -> Any:
            stages = [
                pipelining.PipelineStage(
                    part, s, 4, gpu, input_args=shapes[s], output_args=shapes[s + 1]
                )
                for s, part in enumerate(parts)
            ]
            return getattr(pipelining, kind)(stages, m, loss_fn=gpt_loss)

        def plain() -> None:
            for x, t in zip(scatter(ids, m), scatter(targets, m)):
                (gpt_loss(model(x), t) * (x.shape[0] / ids.shape[0])).backward()

        runs: dict[str, Callable[[], None]] = {"plain": plain}
        for kind in ("ScheduleLoopedBFS", "ScheduleInterleaved1F1B"):
            runner = schedule(kind)
            runs[kind] = lambda runner=runner: runner.step(ids, target=targets, losses=[])
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()
            model.zero_grad(set_to_none=True)
        for _ in range(2 if args.smoke else 5):
            for name, run in runs.items():
                _sync()
                began = time.perf_counter()
                run()
                _sync()
                times[name].append(time.perf_counter() - began)
                model.zero_grad(set_to_none=True)
        plain_ms = statistics.median(times["plain"]) * 1e3
        lines = []
        for name, seconds in times.items():
            ms = statistics.median(seconds) * 1e3
            lines.append(f"  {name:<24} {ms:9.1f} ms  x plain {ms / plain_ms:.3f}")
            if name != "plain":
                _result(f"torch_{name[8:].lower()}_ratio", f"{ms / plain_ms:.3f}")
        dist.destroy_process_group()
        return "torch.distributed.pipelining, 4 stages on one rank:\n" + "\n".join(lines)

    yield "torch pipelining", measure


def section_overhead(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    """The runtime's cost per action on this host's CPUs, beside bare threads (no GPU).

    The same fit as ``benchmarks/overhead.py --stages 4``: on the 2-core development host,
    Python threads alone pay more than the issue's 0.1 ms goal; a host with more cores
    tells whether the runtime meets it where the cores do not run out.
    """
    import io
    from contextlib import redirect_stdout

    import overhead

    def measure() -> str:
        fit = argparse.Namespace(
            stages=[4],
            action_ms=0.5,
            fit_microbatches=[4, 8] if args.smoke else [8, 16, 24, 32],
            fit_steps=2 if args.smoke else 7,
            no_torch=True,
        )
        printed = io.StringIO()
        with redirect_stdout(printed):
            fields = overhead.per_action(fit)
        for name in ("gpipe", "1f1b"):
            for what in (name, f"bare_{name}"):
                beyond = float(fields[f"action_ms_{what}_k4"]) - float(fields["action_ms_plain_k4"])
                _result(f"overhead_beyond_plain_ms_{what.replace('-', '_')}", f"{beyond:.3f}")
        return f"per action, K=4, F=B=0.5 ms, {os.cpu_count()} cores:\n" + printed.getvalue()

    yield "overhead fit", measure


def section_plan(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    """The planner's predicted peak against the CUDA allocator's, after a real step with
    Adam's state in place, and the headroom ``Plan.calibrate`` makes of them."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from gpipe import GPipe, plan

    def measure() -> str:
        device = _device()
        width, layers, batch = (64, 4, 32) if args.smoke else (2048, 8, 2048)
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
        model = nn.Sequential(*blocks).to(device)
        x = torch.randn(batch, width, device=device)
        y = torch.randn(batch, width, device=device)
        report = plan(
            model,
            x,
            batch,
            [device],
            "60GB",
            optimizer="adam",
            loss_fn=F.mse_loss,
            target=y,
            schedules=["1f1b"],
            chunks=[4],
            checkpoints=["never", "always"],
            progress=False,
        )
        lines = []
        for best in report.plans[:2]:
            pipe = GPipe.from_plan(model, best)
            optimizer = torch.optim.Adam(model.parameters())
            for _ in range(2):  # the second step starts with Adam's state in place
                pipe.train_step(x, y, F.mse_loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            headroom = best.calibrate(pipe)
            measured = pipe.cuda_memory.get(torch.device(device))
            _result(f"plan_headroom_{best.checkpoint}", f"{headroom:.3f}")
            lines.append(
                f"{best.describe()}: predicted peak {best.peak_memory[0] / 2**20:.1f} MiB, "
                f"allocator's {'-' if measured is None else f'{measured / 2**20:.1f}'} MiB, "
                f"headroom {headroom:.3f}"
            )
            pipe.close()
            del pipe, optimizer
        return "\n".join(lines)

    yield "plan headroom", measure


def section_generate(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], str]]]:
    """``pipe.generate`` through 4 stages on one GPU against ``model.generate`` whole."""

    def measure() -> str:
        from functools import partial

        import torch

        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            return "skipped: transformers is not installed"
        from gpipe import GPipe, split

        device = _device()
        if args.smoke:
            config = GPT2Config(vocab_size=97, n_embd=32, n_layer=4, n_head=4, n_positions=64)
            prompt, tokens = 8, 8
        else:  # GPT-2 small's shape
            config = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
            prompt, tokens = 32, 128
        config.bos_token_id = config.eos_token_id = None  # every row runs all its tokens
        torch.manual_seed(0)
        model: Any = GPT2LMHeadModel(config)
        model = model.to(device).eval()
        ids = torch.randint(0, config.vocab_size, (8, prompt), device=device)
        per = config.n_layer // 4
        cuts = [f"transformer.h.{per * s}" for s in range(1, 4)]
        stages = split(model, cuts, example_inputs={"input_ids": ids})
        pipe = GPipe(stages, devices=[device] * 4, checkpoint="never")
        runs: dict[str, Callable[[], Any]] = {
            "hf": partial(model.generate, ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=0),
        }  # fmt: skip
        for lanes in (1, 8):
            runs[f"lanes={lanes}"] = partial(pipe.generate, ids, max_new_tokens=tokens, lanes=lanes)
        times: dict[str, list[float]] = {name: [] for name in runs}
        outputs: dict[str, Any] = {}
        for turn in range(1 + (1 if args.smoke else 3)):  # the first: warm-up
            for name, run in runs.items():
                _sync()
                began = time.perf_counter()
                outputs[name] = run()
                _sync()
                if turn:
                    times[name].append(time.perf_counter() - began)
        rate = {name: 8 * tokens / statistics.median(t) for name, t in times.items()}
        lines = [f"8 rows, {prompt} prompt + {tokens} new tokens, greedy, 4 stages on {device}; "
                 f"medians of {len(times['hf'])}"]  # fmt: skip
        for name, tok_s in rate.items():
            same = (outputs[name] == outputs["hf"])[:, prompt:].float().mean().item()
            lines.append(f"  {name:<8} {tok_s:9.1f} tok/s  x hf {tok_s / rate['hf']:.3f}  "
                         f"new ids as hf's: {same:.3f}")  # fmt: skip
            key = name.replace("=", "")
            _result(f"generate_{key}_tok_s", f"{tok_s:.1f}")
            if name != "hf":
                _result(f"generate_{key}_over_hf", f"{tok_s / rate['hf']:.3f}")
        pipe.close()
        return "pipe.generate vs model.generate:\n" + "\n".join(lines)

    yield "generate tokens/s", measure


SECTIONS: dict[str, Callable[[argparse.Namespace], Iterator[tuple[str, Callable[[], str]]]]] = {
    "parity": section_parity,
    "speed": section_speed,
    "torch": section_torch,
    "overhead": section_overhead,
    "plan": section_plan,
    "backward": section_parity,
    "generate": section_generate,
}


def _result(key: str, value: str) -> None:
    print(f"@RESULT {key}={value}", flush=True)


def run_section(args: argparse.Namespace) -> None:
    """Run one section's cases from ``args.start``, each under a watchdog, printing as it goes.

    A case that overruns its timeout has every thread's stack dumped to stderr and the
    process ends at once (``os._exit``: a hung worker cannot be joined); the caller starts
    the section again after it.
    """
    timeout = _CASE_TIMEOUT[args.section] * (4 if args.smoke else 1)
    for index, (name, case) in enumerate(SECTIONS[args.section](args)):
        if index < args.start:
            continue
        print(f"@CASE {index} {name}", flush=True)
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            verdict = case()
        except Exception:
            verdict = "ERROR " + traceback.format_exc().strip().replace("\n", "\n    ")
        faulthandler.cancel_dump_traceback_later()
        first, *more = verdict.splitlines() or [""]
        print(f"@DONE {index} {first}", *(f"\n@MORE {line}" for line in more), sep="", flush=True)
    print("@END", flush=True)
    sys.stdout.flush()
    os._exit(0)  # NOTE: workers of a failed case may still hold locks: do not join them


# -- the driver: runs every section in a process of its own -----------------------------


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.results: dict[str, str] = {}

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def _child(
    args: argparse.Namespace, section: str, start: int, timeout: float
) -> tuple[int, str, str]:
    command = [sys.executable, __file__, "--section", section, "--start", str(start)]
    if args.smoke:
        command.append("--smoke")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PYTHONFAULTHANDLER"] = "1"
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            return -9, out, err


def _run_cases(args: argparse.Namespace, report: Report, section: str, deadline: float) -> None:
    start, failures, total = 0, 0, 0
    began = time.monotonic()
    while True:
        left = min(
            _SECTION_TIMEOUT[section] * (4 if args.smoke else 1), deadline - time.monotonic()
        )
        if left < 5:
            report.say(f"  SKIPPED from case {start}: out of time")
            failures += 1
            break
        code, out, err = _child(args, section, start, left)
        current: tuple[int, str] | None = None
        for line in out.splitlines():
            if line.startswith("@CASE "):
                index, name = line[6:].split(" ", 1)
                current = (int(index), name)
            elif line.startswith("@DONE ") and current is not None:
                verdict = line.split(" ", 2)[2]
                total += 1
                failures += verdict.startswith(("FAIL", "ERROR"))
                report.say(f"  {current[1]}: {verdict}")
                current = None
            elif line.startswith("@MORE "):
                report.say(f"    {line[6:]}")
            elif line.startswith("@RESULT "):
                key, value = line[8:].split("=", 1)
                report.results[key] = value
            elif line.startswith("@END"):
                break
            else:
                report.say(f"  {line}")
        if "@END" in out.splitlines():
            break
        if current is None:
            report.say(f"  CRASHED (exit {code}) before any case:")
            report.say("    " + err.strip()[-3000:].replace("\n", "\n    "))
            failures += 1
            break
        total += 1
        failures += 1
        why = "HUNG" if "Timeout (" in err or code == -9 else f"CRASHED (exit {code})"
        report.say(f"  {current[1]}: {why}; stacks:")
        report.say("    " + err.strip()[-4000:].replace("\n", "\n    "))
        start = current[0] + 1
    report.results[f"{section}_failed"] = str(failures)
    report.results[f"{section}_cases"] = str(total)
    report.say(f"  ({time.monotonic() - began:.0f} s)")


def _run_tests(args: argparse.Namespace, report: Report, deadline: float) -> None:
    """tests/test_cuda.py under pytest; a hung test is deselected and the rest run again."""
    deselected: list[str] = []
    began = time.monotonic()
    passed: set[str] = set()  # NOTE: a rerun after a hang runs the passed tests again
    failed: set[str] = set()
    for _ in range(3):
        left = min(_SECTION_TIMEOUT["tests"], deadline - time.monotonic())
        if left < 10:
            report.say("  SKIPPED: out of time")
            failed.add("(out of time)")
            break
        command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-p", "no:cacheprovider",
                   "-o", f"faulthandler_timeout={max(5, int(left) - 10)}",
                   "tests/test_cuda.py", *(f"--deselect={d}" for d in deselected)]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        with subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        ) as proc:  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=left)
                hung = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
                hung = True
        lines = out.splitlines()
        passed |= {line.split(" ")[0] for line in lines if "::" in line and " PASSED" in line}
        failed |= {
            line.split(" ")[0]
            for line in lines
            if "::" in line and (" FAILED" in line or " ERROR" in line)
        }
        if not hung:
            report.say("    " + "\n    ".join(lines[-40:]))
            if proc.returncode != 0 and not failed:  # pytest itself failed (not installed?)
                failed.add(f"(pytest exit {proc.returncode})")
            break
        running = [line.split(" ")[0] for line in lines if line.startswith("tests/")]
        ended = (" PASSED", " FAILED", " SKIPPED", " ERROR")
        done = {line.split(" ")[0] for line in lines if any(word in line for word in ended)}
        stuck = [name for name in running if name not in done]
        report.say(f"  HUNG in {stuck[-1] if stuck else '?'}; output and stacks:")
        report.say("    " + "\n    ".join(lines[-60:]))
        failed.add(f"{stuck[-1] if stuck else '?'} (hung)")
        if not stuck:
            break
        deselected.append(stuck[-1])
    report.results["tests_passed"] = str(len(passed))
    report.results["tests_failed"] = str(len(failed))
    report.say(f"  ({time.monotonic() - began:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        help=f"the report's file (default {SAVED.relative_to(ROOT)}, written only on a CUDA host)",
    )
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for everything")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on CPU too)")
    parser.add_argument("--only", nargs="+", choices=["tests", *SECTIONS], help="these sections")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_section(args)
        return

    import torch

    began = time.monotonic()
    deadline = began + args.budget
    report = Report()
    report.say(f"CMD {' '.join([Path(sys.executable).name, *sys.argv])}")
    cuda = torch.cuda.is_available()
    card = torch.cuda.get_device_name(0).replace(" ", "_") if cuda else "none"
    report.say(f"CARD {card if cuda else 'none (no CUDA device: nothing but --smoke can run)'}")
    report.say(
        f"MACHINE {platform.machine()} {platform.system()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    report.say(f"START {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    report.results["card"] = card
    if args.out is None and not cuda:
        # NOTE: the saved report is a GPU's; a run without one must not replace it
        print(f"no CUDA device: nothing is written to {SAVED.relative_to(ROOT)} "
              "(give --out to keep this run's report)", flush=True)  # fmt: skip
    if not cuda and not args.smoke:
        report.say("no CUDA device; run with --smoke to try the check's code on CPU")
        report.results["ran"] = "0"
    else:
        for section in args.only or ["tests", *SECTIONS]:
            report.say(f"== {section}")
            if section == "tests":
                _run_tests(args, report, deadline)
            else:
                _run_cases(args, report, section, deadline)
    report.results["seconds"] = f"{time.monotonic() - began:.0f}"
    report.say("RESULT " + " ".join(f"{k}={v}" for k, v in report.results.items()))
    if args.out is not None or cuda:
        out = Path(args.out) if args.out is not None else SAVED
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(report.lines) + "\n")
        print(f"report written to {out}", flush=True)
    failures = sum(int(v) for k, v in report.results.items() if k.endswith("_failed"))
    sys.stdout.flush()
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    main()
