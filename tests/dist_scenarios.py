"""What the ranks of a multi-process test run: each function runs on every rank.

Each compares a DistributedGPipe with plain PyTorch on the same model and batch, computed by
every rank itself (the model is built from a seed), and returns the largest differences, so
the test process asserts on numbers that could fail.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpipe.distributed as gd
from gpipe.distributed.failure import PipelineFailure
from gpipe.planning.candidates import stages_per_device

WIDTH = 6


def mlp(layers: int = 8, *, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        if dropout:
            blocks.append(nn.Dropout(dropout))
    return nn.Sequential(*blocks).double()


class Split(nn.Module):
    """x -> {"h": Linear(x), "skip": x * scale, "note": a string}: a dict crossing a cut."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": self.linear(x), "skip": x * self.scale, "note": "from split", "n": 3}


class Merge(nn.Module):
    """The dict back to a tensor; checks the non-tensor values arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, d: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        assert d["note"] == "from split" and d["n"] == 3, d
        return torch.tanh(self.linear(d["h"])), d["skip"]


class Join(nn.Module):
    """A tuple of two tensors -> one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, skip = pair
        return self.linear(h + skip)


class TupleIn(nn.Module):
    """The model input is a tuple (x, a non-tensor scale)."""

    def forward(self, pair: tuple[torch.Tensor, float]) -> torch.Tensor:
        x, scale = pair
        return x * scale


def structured() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        TupleIn(), Split(0.5), Merge(), Join(), nn.Linear(WIDTH, WIDTH), nn.Tanh()
    ).double()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def _reference(
    build: Callable[[], nn.Sequential], x: Any, y: torch.Tensor, loss_fn: Callable
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    model = build()
    out = model(x)
    loss = loss_fn(out, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, out.detach()


def _compare(
    pipe: gd.DistributedGPipe, model: nn.Sequential, loss: torch.Tensor, ref: Any
) -> dict[str, float]:
    ref_loss, ref_grads, _ = ref
    diffs = {"loss": _diff(loss, ref_loss), "grad": 0.0, "checked": 0.0}
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        assert param.grad is not None, f"{name} held by rank {dist.get_rank()} has no grad"
        diffs["grad"] = max(diffs["grad"], _diff(param.grad, ref_grads[name]))
        diffs["checked"] += 1
    return diffs


def parity(schedules: list[str], checkpoints: list[str], chunks: list[int], batch: int) -> Any:
    """Every schedule x checkpoint x chunk count: loss and this rank's gradients vs plain."""
    world = dist.get_world_size()
    results: dict[str, Any] = {}
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, WIDTH, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    ref = _reference(mlp, x, y, loss_fn)
    for schedule in schedules:
        v = stages_per_device(schedule)
        for checkpoint in checkpoints:
            for m in chunks:
                model = mlp()
                pipe = gd.DistributedGPipe(
                    model,
                    chunks=m,
                    schedule=schedule,
                    checkpoint=checkpoint,
                    virtual_stages=v,
                    timeout=30,
                )
                loss = pipe.train_step(x, y, loss_fn)
                key = f"{schedule}/{checkpoint}/M={m}/K={world}"
                results[key] = _compare(pipe, model, loss, ref)
                out = pipe.eval_step(x)
                results[key]["eval"] = -1.0 if out is None else _diff(out, ref[2])
                pipe.close()
    return results


def structures(schedule: str) -> Any:
    """Tuple and dict inputs, non-tensor values, a changing sequence length, uneven batch."""
    torch.manual_seed(2)
    results: dict[str, Any] = {}
    loss_fn = nn.functional.mse_loss
    model = structured()
    pipe = gd.DistributedGPipe(model, chunks=3, schedule=schedule, timeout=30)
    for step, (batch, length) in enumerate([(7, 5), (7, 3), (4, 5)]):
        x = torch.randn(batch, length, WIDTH, dtype=torch.float64)
        y = torch.randn(batch, length, WIDTH, dtype=torch.float64)
        ref = _reference(structured, (x, 2.0), y, loss_fn)
        for p in model.parameters():
            p.grad = None
        loss = pipe.train_step((x, 2.0), y, loss_fn)
        results[f"step{step}/B={batch}/T={length}"] = _compare(pipe, model, loss, ref)
    pipe.close()
    return results


def structures_batched(schedule: str) -> Any:
    """:func:`structures` through NCCL's poster (one ``batch_isend_irecv`` per batch, which
    returns one work for the whole batch, as NCCL's does), here on gloo; and how many
    operations each batch held."""
    from gpipe.distributed.posting import POSTER

    batches = []
    batch = dist.batch_isend_irecv

    class Coalesced:
        """One work for a whole batch, as NCCL's coalescing returns."""

        def __init__(self, works: list[Any]) -> None:
            self.works = works

        def wait(self) -> bool:
            return all(work.wait() for work in self.works)

    def counted(ops: list[dist.P2POp]) -> list[Any]:
        batches.append(len(ops))
        return [Coalesced(batch(ops))]

    before = os.environ.get(POSTER)
    os.environ[POSTER] = "batched"
    dist.batch_isend_irecv = counted
    try:
        return {"results": structures(schedule), "batches": batches}
    finally:
        dist.batch_isend_irecv = batch
        if before is None:
            del os.environ[POSTER]
        else:
            os.environ[POSTER] = before


def dropout_bitwise(balance: list[int]) -> Any:
    """Gradients with dropout, to compare bitwise with the local GPipe in the test process."""
    model = mlp(4, dropout=0.3)
    pipe = gd.DistributedGPipe(model, balance, chunks=4, schedule="1f1b", timeout=30)
    torch.manual_seed(7)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    pipe.close()
    return {"loss": loss.cpu(), "grads": grads}


def dropout_schedules(schedules: list[str], checkpoints: list[str]) -> Any:
    """Loss and gradients with dropout under each schedule and checkpoint mode, to compare
    with the local pipe of the same schedule in the test process."""
    results: dict[str, Any] = {}
    world = dist.get_world_size()
    for schedule in schedules:
        v = stages_per_device(schedule)
        for checkpoint in checkpoints:
            model = mlp(2 * world, dropout=0.3)  # 3 modules per block: 6 per rank
            chunks = 2 * world
            pipe = gd.DistributedGPipe(
                model,
                [6 // v] * (world * v),
                chunks=chunks,
                schedule=schedule,
                checkpoint=checkpoint,
                virtual_stages=v,
                timeout=30,
            )
            torch.manual_seed(7)
            x = torch.randn(2 * chunks, WIDTH, dtype=torch.float64)
            y = torch.randn(2 * chunks, WIDTH, dtype=torch.float64)
            loss = pipe.train_step(x, y, nn.functional.mse_loss)
            grads = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.device.type != "meta"
            }
            results[f"{schedule}/{checkpoint}"] = {"loss": loss.cpu(), "grads": grads}
            pipe.close()
    return results


def meta_init() -> Any:
    """A model built on meta and initialized by init_fn equals one built normally."""

    def init_fn(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            generator = torch.Generator().manual_seed(module.in_features * 1000 + 7)
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator))

    def build() -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).double()

    with torch.device("meta"):
        model = build()
    pipe = gd.DistributedGPipe(model, chunks=2, init_fn=init_fn, timeout=30)
    plain = build()
    plain.apply(init_fn)
    torch.manual_seed(3)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, WIDTH, dtype=torch.float64)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    ref = nn.functional.mse_loss(plain(x), y)
    ref.backward()
    materialized = [p.device.type for p in model.parameters()]
    diffs = {"loss": _diff(loss, ref), "grad": 0.0}
    for p, q in zip(model.parameters(), plain.parameters()):
        if p.device.type != "meta":
            diffs["grad"] = max(diffs["grad"], _diff(p.grad, q.grad))
    pipe.close()
    return {"diffs": diffs, "devices": materialized}


def fail_at(rank: int, step: int, steps: int = 6) -> Any:
    """Rank ``rank`` raises inside its stage at ``step``; everyone else must end, fast."""
    me = dist.get_rank()

    class Bomb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if me == rank and self.calls == step * 2:  # 2 micro-batches per step
                raise ValueError(f"boom on rank {me}")
            return x

    world = dist.get_world_size()
    model = nn.Sequential(*[layer for _ in range(world) for layer in (nn.Linear(4, 4), Bomb())])
    pipe = gd.DistributedGPipe(model, chunks=2, timeout=60)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    started = time.monotonic()
    for _ in range(steps):
        started = time.monotonic()
        pipe.train_step(x, y, nn.functional.mse_loss)
    return {"finished": True, "elapsed": time.monotonic() - started}


def bad_target_on_the_last_rank(case: str, linger: float = 8.0) -> Any:
    """The last rank gets a bad target ("none", or "short": one sample short), the others a
    good one. That rank raises before any message; it lingers ``linger`` s before it ends,
    so the others cannot learn of it from its links closing."""
    me, world = dist.get_rank(), dist.get_world_size()
    pipe = gd.DistributedGPipe(mlp(world), chunks=2, timeout=60)
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y: torch.Tensor | None = torch.randn(4, WIDTH, dtype=torch.float64)
    if me == world - 1:
        y = None if case == "none" else y[:3]
    try:
        pipe.train_step(x, y, nn.functional.mse_loss)
    except Exception:
        if me == world - 1:
            time.sleep(linger)
        raise
    return {"finished": True}


def new_pipe_after_failure() -> Any:
    """A step fails (a layer raises on rank 1); every rank builds a new pipe like the first
    and trains: it must run, and match plain training."""
    me = dist.get_rank()

    class Bomb(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if me == 1:
                raise ValueError("boom")
            return x

    torch.manual_seed(1)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    y = torch.randn(4, WIDTH, dtype=torch.float64)
    world = dist.get_world_size()
    failing = gd.DistributedGPipe(nn.Sequential(*mlp(world - 1), Bomb()), chunks=2)
    try:
        failing.train_step(x, y, nn.functional.mse_loss)
    except Exception as error:
        failed = f"{type(error).__name__}: {error}"
    else:
        raise AssertionError("the first pipe's step should fail")
    model = mlp(world)
    pipe = gd.DistributedGPipe(model, chunks=2)  # the same layout and timeout as the first
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    ref = _reference(partial(mlp, world), x, y, nn.functional.mse_loss)
    return {"failed": failed, **_compare(pipe, model, loss, ref)}


def stop_at(rank: int, step: int, how: str, timeout_s: float = 60.0) -> Any:
    """Rank ``rank`` dies (SIGKILL), is interrupted (SIGINT) or hangs at ``step``."""
    import os
    import signal

    me = dist.get_rank()
    sig = {"kill": signal.SIGKILL, "interrupt": signal.SIGINT}.get(how)

    class Trap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if me == rank and self.calls == step * 2:
                if sig is None:
                    import sys

                    print(f"hanging at {time.time()!r}", file=sys.stderr, flush=True)
                    time.sleep(3600)  # hung: alive, links open, never sends
                os.kill(os.getpid(), sig)
                time.sleep(1)  # the signal lands here (SIGINT: as KeyboardInterrupt)
            return x

    world = dist.get_world_size()
    model = nn.Sequential(*[layer for _ in range(world) for layer in (nn.Linear(4, 4), Trap())])
    pipe = gd.DistributedGPipe(model, chunks=2, timeout=timeout_s)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(step + 2):
        pipe.train_step(x, y, nn.functional.mse_loss)
    return {"finished": True}


def bad_config(case: str) -> Any:
    """Constructing a pipe that cannot run: the error must come on every rank, before a step."""
    me = dist.get_rank()
    model = mlp(2)  # 4 layers
    kwargs: dict[str, Any] = {"timeout": 30}
    if case == "balance":
        kwargs["balance"] = [1, 1, 2]  # 3 stages for a 2-rank job
    elif case == "too_many_stages":
        model = mlp(1)[:1]  # 1 layer for 2 ranks
    elif case == "different_arguments":
        kwargs["chunks"] = 4 if me == 0 else 8
    elif case == "schedule":
        kwargs.update(schedule="1f1b", virtual_stages=2)
    elif case == "unknown_schedule":
        kwargs["schedule"] = "zigzag"
    elif case == "wider_on_one_rank" and me == 1:  # the same layer types, another width
        model = nn.Sequential(nn.Linear(WIDTH, 9), nn.Tanh(), nn.Linear(9, WIDTH), nn.Tanh())
        model = model.double()
    elif case == "buffer_dtype":
        dtype = torch.float64 if me == 1 else torch.float32
        model[0].register_buffer("scale", torch.ones(3, dtype=dtype))
    try:
        gd.DistributedGPipe(model, **kwargs)
    # NOTE: both ranks find a difference, and the first to report it wins: a rank still
    # comparing when the report comes raises it as a PipelineFailure, in the same words
    except (ValueError, TypeError, PipelineFailure) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": ""}


def settings_changed(case: str) -> Any:
    """Setting schedule/checkpoint after a step: checked when set, run by the next step, and
    refused on every rank when the ranks disagree."""
    me = dist.get_rank()
    torch.manual_seed(1)
    x = torch.randn(8, WIDTH, dtype=torch.float64)
    y = torch.randn(8, WIDTH, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    model = mlp()
    pipe = gd.DistributedGPipe(model, chunks=4, schedule="1f1b", checkpoint="always", timeout=30)
    pipe.train_step(x, y, loss_fn)
    model.zero_grad()
    result: dict[str, Any] = {}
    if case == "bad":
        for name, value in [("checkpoint", "sometimes"), ("schedule", 3), ("schedule", "zigzag")]:
            try:
                setattr(pipe, name, value)
                result[f"{name}={value!r}"] = ""
            except (TypeError, ValueError) as error:
                result[f"{name}={value!r}"] = f"{type(error).__name__}: {error}"
        result["kept"] = [pipe.schedule, pipe.checkpoint]
        pipe.close()
        return result
    if case == "all" or me == 1:
        pipe.schedule, pipe.checkpoint = "gpipe", "never"
    try:
        loss = pipe.train_step(x, y, loss_fn)
    except Exception as error:
        pipe.close()
        return {"error": f"{type(error).__name__}: {error}"}
    result = _compare(pipe, model, loss, _reference(mlp, x, y, loss_fn))
    first = pipe.timeline.events[me][:2]
    result["ran"] = [pipe._last[1].name if pipe._last else None, [e.kind for e in first]]
    pipe.close()
    return result


def timeline_on_one_rank() -> Any:
    """Only rank 0 reads ``pipe.timeline`` (a collective): it must fail, naming the fix."""
    pipe = gd.DistributedGPipe(mlp(2), chunks=2, timeout=4)
    x, y = torch.randn(4, WIDTH, dtype=torch.float64), torch.randn(4, WIDTH, dtype=torch.float64)
    pipe.train_step(x, y, nn.functional.mse_loss)
    if dist.get_rank() == 0:
        return {"makespan": pipe.timeline.makespan}
    return {"asked": False}


def loss_dtype(dp: int) -> Any:
    """A float32 model's loss and gradient norm on every rank, beside plain training's."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    model = copy.deepcopy(plain)
    pipe = gd.DistributedGPipe(model, balance=[2, 2], chunks=2, dp_size=dp)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    reference = nn.functional.mse_loss(plain(x), y)
    reference.backward()
    norm = pipe.clip_grad_norm_(0.5)
    plain_norm = nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    return {
        "dtype": str(loss.dtype),
        "diff": float((loss.double() - reference.detach().double()).abs()),
        "norm_dtype": str(norm.dtype),
        "norm_diff": float((norm.double() - plain_norm.double()).abs()),
    }


def link() -> Any:
    """What the pipe measured of its link, and where: over the pipeline's own group."""
    from gpipe.distributed import construction as pipe_module

    calls: list[Any] = []
    measure = pipe_module.measure_link

    def spy(ranks: list[int], group: Any, device: Any = None, **kwargs: Any) -> Any:
        calls.append((group, device))
        return measure(ranks, group, device, **kwargs)

    pipe_module.measure_link = spy
    pipe_module._LINKS.clear()
    try:
        pipe = gd.DistributedGPipe(mlp(2), chunks=2, timeout=30)
    finally:
        pipe_module.measure_link = measure
    latency, bandwidth = pipe._connections.link
    group, device = calls[0]
    return {
        "latency": latency,
        "bandwidth": bandwidth,
        "pipeline_group": group is pipe.groups.pipeline,
        "device": str(device),
    }


class _LaggingGpu:
    """A fake GPU whose stream gets to each mark ``lag_ms`` after the host queued it."""

    def __init__(self, lag_ms: float) -> None:
        self.lag_ms = lag_ms
        self.marks = 0

    def current_stream(self, device: torch.device) -> str:
        return f"stream of {device}"

    def record(self, stream: str, timing: bool = False) -> tuple[int, int]:
        self.marks += 1
        return (time.perf_counter_ns(), self.marks)

    def elapsed_ms(self, start: tuple[int, int], end: tuple[int, int]) -> float:
        return (end[0] - start[0]) / 1e6 + (self.lag_ms if end != start else 0.0)


def gpu_timed_messages(lag_ms: float = 50.0) -> Any:
    """Each activation's arrival beside the start of the forward that read it, in seconds:
    one step on the host's clock, then one whose messages a (fake) GPU carried, its stream
    ``lag_ms`` behind the host, as NCCL's are: the timeline shows when the GPU had them."""
    from gpipe.runtime import copies

    os.environ["GPIPE_POSTER"] = "batched"  # NcclPoster's path: one batch_isend_irecv each
    pipe = gd.DistributedGPipe(mlp(2), chunks=4, timeout=30)
    x, y = torch.randn(8, WIDTH, dtype=torch.float64), torch.randn(8, WIDTH, dtype=torch.float64)

    def gaps() -> list[float]:
        pipe.train_step(x, y, nn.functional.mse_loss)
        timeline = pipe.timeline
        starts = {
            (e.action.stage, e.action.microbatch): e.start
            for device in timeline.events
            for e in device
            if e.action.kind == "F"
        }
        return [t.end - starts[t.stage, t.microbatch] for t in timeline.transfers if t.kind == "F"]

    host = gaps()
    fake = _LaggingGpu(lag_ms)
    real, copies.cuda = copies.cuda, fake
    try:
        pipe._transport.transfer_log._clock = copies.GpuClock(torch.device("cuda", 0))
        lagged = gaps()
    finally:
        copies.cuda = real
    return {"host": host, "gpu": lagged, "marks": fake.marks}


def planned_layouts(batch: int = 8) -> Any:
    """Every layout ``gpipe.plan(..., world_size=N)`` weighs, built with
    ``DistributedGPipe.from_plan``: loss and this rank's gradients vs plain training."""
    import gpipe

    world = dist.get_world_size()
    torch.manual_seed(1)
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    y = torch.randn(batch, WIDTH, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    ref = _reference(mlp, x, y, loss_fn)
    report = gpipe.plan(
        mlp(),
        x,
        batch,
        ["cpu"] * world,
        world_size=world,
        schedules=("1f1b",),
        checkpoints=("never",),
        chunks=[2],
        top=100,
        repeats=1,
        action_overhead=0.0,
        progress=False,
    )
    results: dict[str, Any] = {}
    for p in sorted([*report.plans, *(r.plan for r in report.rejected)], key=lambda p: p.stages):
        model = mlp()
        pipe = gd.DistributedGPipe.from_plan(model, p, timeout=30)
        loss = pipe.train_step(x, y, loss_fn)
        results[f"K={p.stages}/dp={p.dp}"] = _compare(pipe, model, loss, ref)
        pipe.close()
    other = dataclasses.replace(report.best, stages=report.best.stages * 2 * world)
    try:
        gd.DistributedGPipe.from_plan(mlp(), other, timeout=30)
    except ValueError as error:
        results["refused"] = str(error)
    return results
