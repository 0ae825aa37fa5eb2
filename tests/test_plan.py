"""The planner: known answers on latency stages, the memory budget, prediction vs the runtime."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import make_mlp, reference_step
from gpipe import GPipe
from gpipe.balance import Profile, profile
from gpipe.cli import main
from gpipe.models import delay
from gpipe.planning.host_model import host_share
from gpipe.planning.plan_report import Plan, PlanReport
from gpipe.planning.planner import DEFAULT_SCHEDULES, plan
from gpipe.units import parse_bytes

FLOAT = 4


class RowLatency(nn.Module):
    """An accelerator-like layer: time grows with the rows of the micro-batch."""

    def __init__(self, forward_ms_per_row: float = 0.5) -> None:
        super().__init__()
        self.per_row = forward_ms_per_row / 1e3
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = self.per_row * x.shape[0]
        return delay(x, seconds, 2 * seconds) * self.scale


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def quiet_plan(
    module: nn.Sequential, sample: Any, batch: int, devices: int, *args: Any, **kwargs: Any
) -> PlanReport:
    kwargs.setdefault("progress", False)
    kwargs.setdefault("repeats", 2)
    # NOTE: the runtime's measured cost per action moves with the machine's load; the known
    # answers below are about the schedules, so they leave it out.
    kwargs.setdefault("action_overhead", 0.0)
    return plan(module, sample, batch, ["cpu"] * devices, *args, **kwargs)


@pytest.fixture
def exact_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """RowLatency layers profiled at their nominal times: on a loaded machine each sleep
    overshoots by up to milliseconds, a cost per call that really does favour fewer
    micro-batches there; the known answers are about the planner, not the machine."""
    from gpipe.planning import measurements

    measured = measurements.profile_samples

    def nominal(module: nn.Sequential, samples: list[Any], **kwargs: Any) -> list[Profile]:
        per_row = [getattr(layer, "per_row", 0.0) for layer in module]
        return [
            dataclasses.replace(
                real,
                forward=[p * sample.shape[0] for p in per_row],
                backward=[2 * p * sample.shape[0] for p in per_row],
                cpu=[0.0] * len(per_row),
                spread=[0.0] * len(per_row),
            )
            for real, sample in zip(measured(module, samples, **kwargs), samples)
        ]

    monkeypatch.setattr(measurements, "profile_samples", nominal)


@pytest.mark.usefixtures("exact_latency")
def test_equal_latency_stages_use_every_device_and_the_most_chunks() -> None:
    model = nn.Sequential(*[RowLatency() for _ in range(4)])
    report = quiet_plan(
        model, torch.randn(8, 3), 8, 4, schedules=("gpipe", "1f1b"), checkpoints=("never",), top=100
    )
    best = report.best
    assert (best.stages, best.balance, best.chunks) == (4, [1, 1, 1, 1], 8)
    assert best.devices == ["cpu"] * 4
    by_chunks = {
        p.chunks: p.predicted_step for p in report if p.stages == 4 and p.schedule == best.schedule
    }
    assert by_chunks[8] < by_chunks[4] < by_chunks[2] < by_chunks[1]
    # Fill-drain with equal stages: idle (K-1)/(M+K-1) of the time.
    assert best.bubble == pytest.approx(3 / 11, abs=0.05)
    assert [p.predicted_step for p in report] == sorted(p.predicted_step for p in report)


def test_a_budget_that_excludes_never_picks_checkpointing_and_names_the_budget() -> None:
    model = make_mlp(layers=4, width=32).float()
    x = torch.randn(64, 32)
    kwargs: dict[str, Any] = {"chunks": [4], "schedules": ("gpipe",), "top": 10}
    free = quiet_plan(model, x, 64, 1, **kwargs)
    need = {p.checkpoint: max(p.peak_memory) for p in free}
    assert need["always"] == need["except_last"] < need["never"]
    budget = (need["except_last"] + need["never"]) // 2

    report = quiet_plan(model, x, 64, 1, budget, **kwargs)
    assert report.best.checkpoint in ("except_last", "always")
    assert all(p.checkpoint != "never" for p in report)
    [rejected] = report.rejected
    excess = need["never"] - budget
    assert rejected.plan.checkpoint == "never"
    assert rejected.reason == f"over the memory budget by {excess / 1024:.1f} KiB on device 0"
    assert "over the memory budget" in str(report)


def test_peak_memory_adds_parameters_gradients_and_optimizer_state() -> None:
    model = make_mlp(layers=2, width=8).float()
    x = torch.randn(4, 8)
    kwargs: dict[str, Any] = {"chunks": [1], "schedules": ("gpipe",), "checkpoints": ("never",)}
    sgd = quiet_plan(model, x, 4, 1, **kwargs).best
    adam = quiet_plan(model, x, 4, 1, optimizer="adam", **kwargs).best
    params = 2 * (8 * 8 + 8) * FLOAT
    assert sgd.peak_memory[0] - sgd.activation_memory[0] == 2 * params  # weights + gradients
    assert adam.peak_memory[0] - adam.activation_memory[0] == 4 * params


def test_the_profile_counts_a_tensor_two_neighbours_save_once() -> None:
    # Linear saves its input, Tanh its output, which the next Linear saves as its input.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    measured = profile(model, torch.randn(2, 8), repeats=1, warmup=0)
    assert measured.activation_bytes == [2 * 8 * FLOAT, 2 * 16 * FLOAT, 0]
    assert measured.input_bytes == [2 * 8 * FLOAT, 2 * 16 * FLOAT, 2 * 16 * FLOAT]
    # A stage starting at the second Linear still keeps its input.
    assert measured.stage_activation_bytes(2, 3) == 2 * 16 * FLOAT
    assert measured.stage_activation_bytes(0, 3) == (2 * 8 + 2 * 16) * FLOAT


def test_predicted_activation_memory_matches_the_runtime() -> None:
    model = make_mlp(layers=6, width=16).float()
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    report = quiet_plan(model, x, 16, 3, loss_fn=squared_error, target=y, chunks=[2, 8], top=500)
    picked = {(p.schedule, p.checkpoint): p for p in report if p.stages == 3}
    assert len(picked) == 3 * len(DEFAULT_SCHEDULES)
    for p in picked.values():
        pipe = GPipe.from_plan(model, p)
        pipe.train_step(x, y, squared_error)
        # the same rule, walked in the same order: exact, zero-bubble's deferred W included
        assert p.activation_memory == pipe.timeline.peak_memory, p.describe()
    model.zero_grad(set_to_none=True)


def test_from_plan_trains_like_the_plain_model() -> None:
    model = make_mlp(layers=4, width=6)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    best = quiet_plan(model, x, 8, 2, schedules=("1f1b",), chunks=[4]).best
    assert set(best.pipe_kwargs()) == {
        "balance",
        "devices",
        "chunks",
        "checkpoint",
        "schedule",
        "virtual_stages",
    }
    _, loss, grads, _ = reference_step(model, x, y, squared_error)
    pipe = GPipe.from_plan(model, best)
    assert (pipe.chunks, pipe.schedule) == (4, "1f1b")
    assert torch.allclose(pipe.train_step(x, y, squared_error), loss)
    for param, grad in zip(model.parameters(), grads):
        assert torch.allclose(param.grad, grad)


def test_interleaved_needs_two_layers_per_device() -> None:
    report = quiet_plan(
        make_mlp(layers=2, width=4).float(),
        torch.randn(4, 4),
        4,
        3,
        schedules=("interleaved",),
        checkpoints=("never",),
        top=100,
    )
    assert {(p.stages, p.virtual_stages, len(p.balance)) for p in report} == {(2, 2, 4)}


def test_report_table_and_plan_names() -> None:
    report = quiet_plan(make_mlp(layers=2, width=4).float(), torch.randn(4, 4), 4, 2, top=2)
    lines = str(report).splitlines()
    assert lines[0].split()[:4] == ["#", "schedule", "K", "v"]
    assert lines[1].startswith("1") and lines[2].startswith("2")
    assert "slower: +" in str(report)
    assert len(report) == 2 and report[0] is report.best
    assert isinstance(report.best, Plan)
    assert report.best.describe().startswith(report.best.schedule)


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("200MB", 200_000_000), ("1.5GiB", 3 * 2**29), ("64 kib", 65536)],
)
def test_sizes_parse_with_decimal_and_binary_units(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
        ({"devices": []}, ValueError, r"devices is empty: give one device per stage"),
        ({"devices": ["cpu", "cpu,cpu"]}, ValueError, "unknown device 'cpu,cpu'"),
        ({"devices": ["meta"]}, ValueError, "device 'meta' holds no data"),
        ({"schedules": ("interleaved",), "devices": ["cpu"]}, ValueError, "nothing to plan"),
        ({"memory_per_device": "lots"}, ValueError, "like 200MB"),
        ({"schedules": ("fast",)}, ValueError, "unknown schedule 'fast'"),
        ({"checkpoints": ("sometimes",)}, ValueError, "checkpoint must be one of"),
        ({"chunks": [16]}, ValueError, "between 1 and batch_size=8"),
        ({"loss_fn": squared_error}, ValueError, "pass target="),
        ({"module": nn.Linear(4, 4)}, TypeError, r"nn.Sequential\(\*layers\)"),
        ({"memory_per_device": 64}, ValueError, "smallest predicted need is"),
    ],
)
def test_bad_inputs_are_rejected_naming_the_fix(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    call: dict[str, Any] = {
        "module": make_mlp(layers=2, width=4),
        "sample": torch.randn(8, 4, dtype=torch.float64),
        "batch_size": 8,
        "devices": ["cpu", "cpu"],
        "progress": False,
        "repeats": 1,
    }
    call.update(kwargs)
    with pytest.raises(error, match=message):
        plan(**call)


def result_fields(output: str) -> dict[str, str]:
    last = output.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(field.split("=", 1) for field in last.split()[1:])


def test_cli_plans_the_tiny_gpt_and_prints_the_result_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "plan",
            "--stages",
            "2",
            "--batch-size",
            "4",
            "--schedules",
            "gpipe,1f1b",
            "--repeats",
            "1",
            "--memory-per-device",
            "64MiB",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    fields = result_fields(out)
    assert fields["best_schedule"] in ("gpipe", "1f1b")
    assert fields["checkpoint"] in ("never", "except_last", "always")
    assert 1 <= int(fields["stages"]) <= 2 and 4 % int(fields["chunks"]) == 0
    assert float(fields["predicted_ms"]) > 0
    assert 0 < int(fields["peak_memory"]) <= 64 * 2**20
    assert "memory budget per device: 64.0 MiB" in out


def test_cli_plans_a_users_factory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_models.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        [
            "plan",
            "--model",
            "user_models:build",
            "--sample-shape",
            "12",
            "--devices",
            "cpu,cpu",
            "--batch-size",
            "4",
            "--repeats",
            "1",
            "--schedules",
            "gpipe",
            "--no-progress",
        ]
    )
    assert code == 0
    assert result_fields(capsys.readouterr().out)["best_schedule"] == "gpipe"

    code = main(["plan", "--model", "user_models:build", "--no-progress"])
    assert code == 2
    assert "--sample-shape" in capsys.readouterr().err


def _profile_with_cpu(cores_busy: float, layers: int = 4) -> Profile:
    zeros = [0] * layers
    return Profile(
        names=["Layer"] * layers,
        forward=[0.001] * layers,
        backward=[0.002] * layers,
        output_bytes=zeros,
        activation_bytes=zeros,
        parameter_bytes=zeros,
        gradient_bytes=zeros,
        optimizer_bytes=zeros,
        cpu=[0.003 * cores_busy] * layers,
    )


def test_cpu_stages_that_compute_share_the_hosts_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    spans = [(0, 1), (1, 2), (2, 3), (3, 4)]
    # four stages computing with 2 intra-op threads each, on a 2-core host: 4x slower
    assert host_share(_profile_with_cpu(1.0), spans, ["cpu"] * 4) == pytest.approx(4.0)
    # stages that mostly wait (an accelerator, a sleep) use a little of one core: no slowdown
    assert host_share(_profile_with_cpu(0.3), spans, ["cpu"] * 4) == 1.0
    # accelerators share nothing
    assert (
        host_share(_profile_with_cpu(2.0), spans, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]) == 1.0
    )
    # two stages on each of two devices (interleaved) still run one at a time per device
    assert host_share(_profile_with_cpu(1.0), spans, ["cpu"] * 2) == pytest.approx(2.0)


@pytest.mark.usefixtures("exact_latency")
def test_a_costly_action_makes_fewer_micro_batches_win() -> None:
    model = nn.Sequential(*[RowLatency() for _ in range(4)])
    common: dict[str, Any] = {"schedules": ("gpipe",), "checkpoints": ("never",)}
    free = quiet_plan(model, torch.randn(8, 3), 8, 4, **common)
    costly = quiet_plan(model, torch.randn(8, 3), 8, 4, action_overhead=0.01, **common)
    assert free.best.chunks == 8
    assert costly.best.chunks < 8  # 10 ms an action outweighs a smaller bubble
    with pytest.raises(ValueError, match="action_overhead must be >= 0"):
        quiet_plan(model, torch.randn(8, 3), 8, 4, action_overhead=-1.0)


@pytest.mark.usefixtures("exact_latency")
def test_auto_is_offered_and_never_predicted_slower_than_a_named_schedule() -> None:
    # Latency stages whose backward is twice the forward, split by the profile into B and W.
    model = nn.Sequential(*[RowLatency() for _ in range(8)])
    report = quiet_plan(model, torch.randn(8, 3), 8, 4, chunks=[4, 8], checkpoints=("never",))
    plans = [*report, *(r.plan for r in report.rejected)]
    for k in (2, 4):
        for m in (4, 8):
            same = [p for p in plans if (p.stages, p.chunks) == (k, m)]
            auto = next(p for p in same if p.schedule == "auto")
            named = [p for p in same if p.schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2")]
            assert auto.predicted_step <= min(p.predicted_step for p in named) * (1 + 1e-9)
    assert {p.schedule for p in plans} >= {"auto", "zb-h2", "zb-v"}


def test_auto_plan_carries_its_searched_schedule_and_trains_like_the_plain_model() -> None:
    model = make_mlp(layers=4, width=6)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    report = quiet_plan(model, x, 8, 2, schedules=("auto",), chunks=[4], top=10)
    best = report.best
    assert best.schedule == "auto" and best.built is not None
    assert best.pipe_kwargs()["schedule"] is best.built
    _, loss, grads, _ = reference_step(model, x, y, squared_error)
    pipe = GPipe.from_plan(model, best)
    assert torch.allclose(pipe.train_step(x, y, squared_error), loss)
    for param, grad in zip(model.parameters(), grads):
        assert torch.allclose(param.grad, grad)


def test_host_share_follows_the_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    spans = [(s, s + 1) for s in range(8)]
    busy = [0.003, 0.003, 0.0, 0.0, 0.0, 0.0, 0.003, 0.003]
    computing = dataclasses.replace(_profile_with_cpu(1.0, layers=8), cpu=busy)
    v, round_robin = (0, 1, 2, 3, 3, 2, 1, 0), (0, 1, 2, 3, 0, 1, 2, 3)
    # V (zb-v): the computing layers 0, 7 and 1, 6 pair up on devices 0 and 1, which compute
    # throughout with both their threads: 4 cores wanted on 2.
    assert host_share(computing, spans, ["cpu"] * 4, v) == pytest.approx(2.0)
    # Round-robin: every device computes half the time, 0.5 * (1 + 0.5) cores each: 3 on 2.
    assert host_share(computing, spans, ["cpu"] * 4, round_robin) == pytest.approx(1.5)


def two_stages(report: PlanReport) -> Plan:
    """The report's two-stage plan (which of one or two stages ranks first is a timing call
    that noise can flip between two reports)."""
    return next(p for p in report.plans if p.stages == 2)


def test_zero_over_replicas_shards_exactly_the_optimizer_state() -> None:
    # NOTE: two layers, so two stages have one balance, whatever the measured times say.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    sample = torch.randn(4, 64)
    kwargs = dict(optimizer="adam", schedules=["1f1b"], chunks=[2], checkpoints=["never"])

    one = two_stages(quiet_plan(model, sample, 8, 2, **kwargs))
    four = two_stages(quiet_plan(model, sample, 32, 2, dp=4, zero=True, **kwargs))
    assert (four.dp, four.zero, one.dp) == (4, True, 1)
    # The same per-replica batch (8 samples), so activations match; AdamW's two moments of
    # each device's weights drop to a quarter.
    assert (four.stages, four.balance) == (one.stages, one.balance)
    assert four.activation_memory == one.activation_memory
    per_device = [
        sum(p.numel() * 4 for layer in model[a:b] for p in layer.parameters())
        for a, b in [(0, one.balance[0]), (one.balance[0], len(model))][: one.stages]
    ]
    saved = [o - f for o, f in zip(one.peak_memory, four.peak_memory)]
    assert saved == [2 * w - -(-2 * w // 4) for w in per_device]
    assert "dp=4 zero" in four.describe()


def test_allreduce_bandwidth_adds_the_ring_time_to_the_step() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    kwargs = dict(schedules=["gpipe"], chunks=[1], checkpoints=["never"])
    free = quiet_plan(model, torch.randn(2, 256), 4, 1, dp=2, **kwargs).best
    slow = quiet_plan(model, torch.randn(2, 256), 4, 1, dp=2, allreduce_bandwidth=1e6, **kwargs)
    weights = sum(p.numel() * 4 for p in model.parameters())
    ring = 2 * (2 - 1) / 2 * weights / 1e6  # one device: all of its gradients, over the ring
    assert slow.best.predicted_step == pytest.approx(free.predicted_step + ring, rel=0.05)


@pytest.mark.parametrize(("dp", "message"), [(3, "divide batch_size=8"), (0, "must be >= 1")])
def test_a_replica_count_that_does_not_split_the_batch_is_refused(dp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quiet_plan(make_mlp(), torch.randn(2, 8), 8, 2, dp=dp)


def test_the_plan_says_why_its_schedule_won_against_every_other_at_its_k_and_m() -> None:
    from gpipe.cli.plan_text import why_this_schedule
    from gpipe.planning.plan_report import PlanReport, Rejection

    model = make_mlp(layers=8, width=16).float()
    report = quiet_plan(model, torch.randn(16, 16), 16, 2, chunks=[4], checkpoints=("never",))
    weighed = [p for p in [*report.plans, *(r.plan for r in report.rejected)] if p.stages == 2]
    # every schedule is weighed by default, the newest too (M = 4 >= 2K for dualpipev)
    assert {p.schedule for p in weighed} == set(DEFAULT_SCHEDULES)
    # the report of the plans at K = 2: the fastest, then the others it beat
    weighed.sort(key=lambda p: p.predicted_step)
    best, others = weighed[0], weighed[1:]
    at_two = PlanReport([best], [Rejection(p, "slower") for p in others], None)
    (line,) = why_this_schedule(at_two)
    assert line.startswith(f"why {best.schedule}: at K=2 M=4 checkpoint never, predicted step")
    for name in DEFAULT_SCHEDULES:
        assert f" {name} " in line, name
    assert f"{best.schedule} {best.predicted_step * 1e3:.2f} ms" in line


def test_fsdp_holds_a_share_of_each_stage_and_the_whole_of_it_within_a_step() -> None:
    # Two layers, two stages: one balance whatever the measured times (as above).
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    sample = torch.randn(4, 64)
    kwargs = dict(optimizer="adam", schedules=["1f1b"], chunks=[2], checkpoints=["never"])

    whole = two_stages(quiet_plan(model, sample, 16, 2, dp=4, **kwargs))
    sharded = two_stages(quiet_plan(model, sample, 16, 2, dp=4, data_parallel="fsdp", **kwargs))
    assert (sharded.data_parallel, whole.data_parallel) == ("fsdp", "replicate")
    assert sharded.activation_memory == whole.activation_memory
    weights = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model]
    # held whole: weights, gradients, Adam's two moments; under FSDP: a quarter of the
    # weights and moments, plus the weights gathered and the gradients unsharded
    held = [w + w + 2 * w for w in weights]
    shard = [-(-w // 4) + w + w + -(-2 * w // 4) for w in weights]
    assert [p - a for p, a in zip(whole.peak_memory, whole.activation_memory)] == held
    assert [p - a for p, a in zip(sharded.peak_memory, sharded.activation_memory)] == shard
    assert "dp=4 fsdp" in sharded.describe()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(data_parallel="zero3"), ValueError, "data_parallel must be one of"),
        (dict(data_parallel=2), TypeError, "data_parallel must be one of"),
        (dict(data_parallel="fsdp", zero=True, dp=2), ValueError, "FSDP shards the optimizer"),
    ],
)
def test_an_engine_the_pipe_does_not_have_is_refused(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        quiet_plan(make_mlp(), torch.randn(2, 8), 8, 2, **kwargs)
