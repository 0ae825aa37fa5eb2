"""GPipe's API: construction, sequence access, inputs of any structure, modes, failures."""

from __future__ import annotations

import copy
import statistics
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe
from gpipe.models import sleep_stages
from gpipe.schedule import SCHEDULES, Action, Schedule, ScheduleError


def test_partitions_hold_the_users_own_layers() -> None:
    model = make_mlp(4)
    pipe = GPipe(model, [3, 5], chunks=2)
    assert isinstance(pipe.partitions, nn.ModuleList) and len(pipe.partitions) == 2
    assert [len(p) for p in pipe.partitions] == [3, 5]
    assert pipe.partitions[1][0] is model[3]
    assert pipe.balance == [3, 5] and pipe.chunks == 2 and pipe.checkpoint == "except_last"
    assert pipe.devices == [torch.device("cpu")] * 2


def test_pipe_is_sequence_like_as_torchgpipe() -> None:
    model = make_mlp(3)
    pipe = GPipe(model, [2, 4])
    assert len(pipe) == 6
    assert pipe[0] is model[0] and pipe[-1] is model[5]
    assert list(pipe) == list(model)
    with pytest.raises(IndexError):
        pipe[6]


def test_parameters_are_the_models_parameters() -> None:
    model = make_mlp(4)
    pipe = GPipe(model, [4, 4])
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}


def test_default_balance_splits_parameters_evenly_without_empty_stage() -> None:
    model = nn.Sequential(
        nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU()
    )
    pipe = GPipe(model, devices=["cpu", "cpu", "cpu"])
    assert pipe.balance == [1, 4, 1]  # the big layer alone; fewest layers last
    assert all(b >= 1 for b in pipe.balance)


def test_tuple_inputs_and_outputs_flow_through_stages() -> None:
    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(
            self, pair: tuple[torch.Tensor, torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = pair
            return torch.tanh(self.a(x) + y), self.b(y)

    torch.manual_seed(0)
    model = nn.Sequential(Mix(), Mix(), Mix()).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    y = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    out_plain = model((x, y))
    (out_plain[0].sum() + out_plain[1].pow(2).sum()).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    expected_y = y.grad.clone()
    model.zero_grad()
    y.grad = None

    pipe = GPipe(model, [1, 1, 1], chunks=3)
    out = pipe((x, y))
    (out[0].sum() + out[1].pow(2).sum()).backward()
    assert_close(out[0], out_plain[0])
    for p, g in zip(model.parameters(), expected):
        assert_close(p.grad, g)
    assert_close(y.grad, expected_y)


def test_dict_input_with_non_tensor_value_reaches_every_microbatch() -> None:
    seen = []

    class Scale(nn.Module):
        def forward(self, batch: dict) -> torch.Tensor:
            seen.append(batch["factor"])
            return batch["x"] * batch["factor"]

    pipe = GPipe(nn.Sequential(Scale(), nn.Identity()), [1, 1], chunks=4)
    x = torch.arange(8.0).view(8, 1)
    with torch.no_grad():
        out = pipe({"x": x, "factor": 3})
    assert torch.equal(out, x * 3)
    assert seen == [3, 3, 3, 3]


def test_no_grad_runs_forward_only_and_keeps_nothing() -> None:
    model = make_mlp(4)
    pipe = GPipe(model, [4, 4], chunks=4)
    x = torch.randn(8, 6, dtype=torch.float64)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    assert_close(out, model(x).detach())
    assert [e.action.kind for e in pipe.timeline.events[0]] == ["F"] * 4
    assert pipe.timeline.peak_memory == [0, 0]


def test_eval_mode_turns_dropout_off_and_does_not_checkpoint() -> None:
    model = make_mlp(4, dropout=0.5).eval()
    pipe = GPipe(model, [6, 6], chunks=2, checkpoint="always").eval()
    x = torch.randn(4, 6, dtype=torch.float64)
    assert_close(pipe(x), model(x))
    # nothing was checkpointed: every micro-batch kept activations beyond its input
    input_bytes = 2 * 6 * 8
    assert min(e.memory for e in pipe.timeline.events[0]) > input_bytes


def test_timeline_records_every_action_once() -> None:
    pipe = GPipe(make_mlp(4), [2, 2, 2, 2], chunks=3)
    pipe.train_step(
        torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64), F.mse_loss
    )
    timeline = pipe.timeline
    assert timeline.devices == 4
    for stage, events in enumerate(timeline.events):
        assert sorted((e.action.kind, e.action.microbatch) for e in events) == sorted(
            [("F", i) for i in range(3)] + [("B", i) for i in range(3)]
        )
        assert all(e.action.stage == stage and e.end >= e.start >= 0 for e in events)
    assert 0 < timeline.bubble < 1
    assert timeline.makespan > 0


class Fails(nn.Module):
    def __init__(self, when: str, microbatch: int) -> None:
        super().__init__()
        self.when, self.microbatch, self.calls = when, microbatch, 0
        self.linear = nn.Linear(6, 6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.when == "forward" and self.calls == self.microbatch:
            self.calls += 1
            raise ArithmeticError("bad forward")
        self.calls += 1
        out = self.linear(x)
        if self.when == "backward":
            out = _FailBackward.apply(out)
        return out


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ArithmeticError("bad backward")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("when", ["forward", "backward"])
def test_exception_in_a_stage_reaches_caller_without_hang(when: str) -> None:
    model = nn.Sequential(nn.Linear(6, 6), Fails(when, 1), nn.Linear(6, 6)).double()
    pipe = GPipe(model, [1, 1, 1], chunks=4, checkpoint="never")
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(ArithmeticError, match=rf"bad {when}.*stage 1") as info:
        pipe.train_step(x, target, F.mse_loss)
    if when == "forward":
        assert "micro-batch 1" in str(info.value)
    pipe.close()  # returns only once every worker thread has ended: none was left blocked
    assert not [t for t in threading.enumerate() if t.name.startswith("gpipe-")]
    # the next step trains exactly like the plain model: nothing of the failed one is left
    model[1].when = "never"
    model.zero_grad(set_to_none=True)
    plain = copy.deepcopy(model)
    _, expected_loss, expected_grads, _ = reference_step(plain, x, target, F.mse_loss)
    assert_close(pipe.train_step(x, target, F.mse_loss), expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
    assert [len(events) for events in pipe.timeline.events] == [8, 8, 8]


@pytest.mark.timeout(30)
def test_exception_during_user_backward_reaches_caller() -> None:
    model = nn.Sequential(nn.Linear(6, 6), Fails("backward", 0), nn.Linear(6, 6)).double()
    pipe = GPipe(model, [1, 1, 1], chunks=2)
    out = pipe(torch.randn(4, 6, dtype=torch.float64))
    with pytest.raises(ArithmeticError, match="bad backward"):
        out.sum().backward()


def test_train_step_under_no_grad_is_an_error() -> None:
    pipe = GPipe(make_mlp(2), [2, 2])
    with torch.no_grad(), pytest.raises(RuntimeError, match="no_grad"):
        pipe.train_step(torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6), F.mse_loss)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"balance": [3, 3]}, ValueError, "sums to 6 but the module has 8 layers"),
        ({"balance": [4, 0, 4]}, ValueError, "at least one layer"),
        ({"balance": [5, -1, 4]}, ValueError, "at least one layer"),
        ({"balance": "4,4"}, ValueError, "list of layers per stage"),
        ({"balance": [4, 2, 2], "devices": ["cpu"] * 2}, ValueError, "balance lists 3 stages"),
        ({"devices": ["cpu"] * 9}, ValueError, "more stages"),
        ({"balance": [4, 4], "chunks": 0}, ValueError, "chunks must be an int >= 1"),
        ({"balance": [4, 4], "checkpoint": "sometimes"}, ValueError, "'except_last'"),
        ({"balance": [4, 4], "schedule": "magic"}, ValueError, "unknown schedule 'magic'"),
        ({"balance": [4, 4], "devices": "cpu"}, TypeError, "one device per stage"),
        ({"balance": 3}, TypeError, r"got 3; for 3 stages, pass devices=\[\.\.\.\] with 3"),
        ({"balance": [4, 4], "devices": []}, ValueError, "devices is empty"),
        ({"balance": [4, 4], "devices": ["meta", "meta"]}, ValueError, "'meta' holds no data"),
        ({"balance": [4, 4], "devices": ["cpu", "gpu"]}, ValueError, "unknown device 'gpu'"),
        ({"balance": [4, 4], "devices": ["cpu", None]}, TypeError, "got None"),
        ({"balance": [4, 4], "track_memory": "no"}, TypeError, "track_memory must be True"),
        ({"balance": [4, 4], "deferred_batch_norm": 1}, TypeError, "deferred_batch_norm"),
    ],
)
def test_bad_construction_names_the_fix(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GPipe(make_mlp(4), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:1"], [0, 1], ["cpu", "cuda"]])
def test_cuda_devices_without_cuda_name_the_fix(devices: list) -> None:
    with pytest.raises(ValueError, match=r"no cuda device .*use devices=\['cpu'"):
        GPipe(make_mlp(4), [4, 4], devices=devices)


def test_module_must_be_sequential() -> None:
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        GPipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        (torch.randn(0, 6, dtype=torch.float64), ValueError, "empty"),
        ((torch.randn(4, 6), torch.randn(3, 6)), ValueError, "same batch size"),
    ],
)
def test_bad_batches_name_the_fix(batch: object, error: type, match: str) -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    with pytest.raises(error, match=match):
        pipe(batch)


def test_loss_fn_must_be_a_function() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"loss_fn must be a function .* got 'mse'"):
        pipe.train_step(x, x, "mse")  # type: ignore[arg-type]


def test_a_loss_fn_returning_a_number_is_told_to_return_the_tensor() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"loss_fn must return a tensor .* got float .*item\(\)"):
        pipe.train_step(x, x, lambda y, t: F.mse_loss(y, t).item())


def test_target_batch_must_match_input() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    with pytest.raises(ValueError, match="target has batch size 3 but input has 4"):
        pipe.train_step(torch.randn(4, 6, dtype=torch.float64), torch.randn(3, 6), F.mse_loss)


def test_moving_the_pipe_is_denied_but_dtype_is_fine() -> None:
    pipe = GPipe(make_mlp(2).float(), [2, 2])
    for move in (
        lambda: pipe.to("cpu"),
        lambda: pipe.cpu(),
        lambda: pipe.cuda(),
        lambda: pipe.to(device="cpu"),
    ):
        with pytest.raises(TypeError, match="devices="):
            move()
    pipe.to(torch.float64)
    assert next(pipe.parameters()).dtype == torch.float64


def test_layer_moved_after_wrapping_is_reported() -> None:
    model = make_mlp(2)
    pipe = GPipe(model, [2, 2])
    model[2].to("meta")
    with pytest.raises(ValueError, match=r"'2\.weight' of stage 1 is on meta.*devices="):
        pipe(torch.randn(2, 6, dtype=torch.float64))


def _head_heavy_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)]
    return nn.Sequential(nn.Embedding(50, 32), *blocks, nn.Linear(32, 16000))


@pytest.mark.parametrize("how", ["params", "time", "memory"])
def test_balance_by_name_measures_the_model_and_covers_every_layer(how: str) -> None:
    model = _head_heavy_model()
    sample = torch.randint(0, 50, (16, 8))
    pipe = GPipe(model, how, devices=["cpu"] * 3, chunks=4, sample=sample)
    assert sum(pipe.balance) == len(model) and all(b >= 1 for b in pipe.balance)
    assert pipe.balance[-1] == 1  # the 16000-wide head outweighs all the rest 100x: alone


def test_balance_by_time_without_sample_names_the_fix() -> None:
    with pytest.raises(ValueError, match="pass sample="):
        GPipe(_head_heavy_model(), "time", devices=["cpu"] * 2)


def test_unknown_balance_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="'params', 'time', 'memory'"):
        GPipe(make_mlp(2), "speed", devices=["cpu"] * 2)


def test_from_plan_builds_the_pipe_the_plan_describes() -> None:
    class Plan:
        def pipe_kwargs(self) -> dict:
            return {
                "balance": [1, 3],
                "devices": ["cpu", "cpu"],
                "chunks": 3,
                "checkpoint": "never",
                "schedule": "1f1b",
                "virtual_stages": 1,
            }

    pipe = GPipe.from_plan(make_mlp(2), Plan())
    assert (pipe.balance, pipe.chunks, pipe.checkpoint, pipe.schedule) == (
        [1, 3],
        3,
        "never",
        "1f1b",
    )


def test_interleaved_pipe_call_and_backward_match_plain_training() -> None:
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(9, 6, dtype=torch.float64)
    expected, _, expected_grads, expected_x = reference_step(make_mlp(), x, target, F.mse_loss)
    model = make_mlp()
    pipe = GPipe(
        model, [2] * 8, devices=["cpu"] * 4, virtual_stages=2, chunks=4, schedule="interleaved"
    )
    out = pipe(x)
    F.mse_loss(out, target).backward()
    assert_close(out, expected)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)
    assert_close(x.grad, expected_x)
    assert [len(events) for events in pipe.timeline.events] == [16, 16, 16, 16]


def test_autocast_of_the_caller_reaches_every_stage() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    pipe = GPipe(model, [1, 1, 1], chunks=2)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        expected = model(x)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected)
    out.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32


def test_predicted_timeline_uses_the_measured_costs() -> None:
    pipe = GPipe(sleep_stages(3, 4, 8), [1, 1, 1], chunks=4, checkpoint="never", schedule="1f1b")
    x, target = torch.randn(4, 2), torch.randn(4, 2)
    pipe.train_step(x, target, F.mse_loss)
    measured, predicted = pipe.timeline, pipe.predicted_timeline()
    assert predicted.unit == "s" and predicted.schedule == "1f1b"
    assert [len(e) for e in predicted.events] == [len(e) for e in measured.events]
    # the prediction never waits on anything but the measured work itself
    assert 0 < predicted.makespan <= measured.makespan
    median_forward = statistics.median(measured.durations("F")[1])
    assert predicted.durations("F")[1] == pytest.approx([median_forward] * 4)


def test_predicted_timeline_shows_the_counted_bytes() -> None:
    pipe = GPipe(make_mlp(4, width=16), [4, 4], chunks=4, checkpoint="never", schedule="1f1b")
    x, target = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    pipe.train_step(x, target, F.mse_loss)
    measured, predicted = pipe.timeline, pipe.predicted_timeline()
    assert predicted.peak_memory == measured.peak_memory
    assert min(predicted.peak_memory) > 4 * 2 * 16 * 8  # bytes, not micro-batch counts
    shown = [line for line in str(predicted).splitlines() if line.startswith("peak memory")]
    assert shown == [line for line in str(measured).splitlines() if line.startswith("peak memory")]
    assert shown[0].endswith("KiB")
    with pytest.raises(ValueError, match="transfer must be seconds >= 0"):
        pipe.predicted_timeline(transfer=-1.0)


@pytest.mark.timeout(30)
def test_a_custom_schedule_that_would_deadlock_is_refused_not_run(monkeypatch) -> None:
    def backwards_first(stages: int, microbatches: int) -> Schedule:
        # every device starts with a backward whose forward has not run: a deadlock
        actions = [
            [Action("B", k, i) for i in range(microbatches)]
            + [Action("F", k, i) for i in range(microbatches)]
            for k in range(stages)
        ]
        return Schedule("backwards-first", tuple(map(tuple, actions)), microbatches)

    monkeypatch.setitem(SCHEDULES, "backwards-first", backwards_first)
    with pytest.raises(ScheduleError, match="waits for"):
        GPipe(make_mlp(2), [2, 2], chunks=2, schedule="backwards-first")


def test_a_custom_registered_schedule_trains_like_plain_pytorch(monkeypatch) -> None:
    def forward_all_then_backward_in_order(stages: int, microbatches: int) -> Schedule:
        actions = [
            [Action("F", k, i) for i in range(microbatches)]
            + [Action("B", k, i) for i in range(microbatches)]
            for k in range(stages)
        ]
        return Schedule("in-order", tuple(map(tuple, actions)), microbatches)

    monkeypatch.setitem(SCHEDULES, "in-order", forward_all_then_backward_in_order)
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    _, expected_loss, expected_grads, _ = reference_step(make_mlp(), x, target, F.mse_loss)
    model = make_mlp()
    loss = GPipe(model, [4, 4, 8], chunks=4, schedule="in-order").train_step(x, target, F.mse_loss)
    assert_close(loss, expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)


@pytest.mark.timeout(30)
def test_keyboard_interrupt_in_a_stage_stops_every_worker() -> None:
    class Interrupt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Interrupt(), nn.Linear(4, 4))
    pipe = GPipe(model, [1, 1, 1, 1], chunks=4)
    with pytest.raises(KeyboardInterrupt):
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss)
    pipe.close()  # returns only once every worker thread has ended: none was left blocked
    assert not [t for t in threading.enumerate() if t.name.startswith("gpipe-")]
    # the failed step ran no action after the interrupt reached the others
    ran = [len(events) for events in pipe.timeline.events]
    assert ran[3] == 0 and sum(ran) < 3 * 4


def test_track_memory_off_records_no_bytes_and_changes_nothing_else() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    tracked, untracked = make_mlp(), make_mlp()
    loss = GPipe(tracked, [8, 8], chunks=4).train_step(x, target, F.mse_loss)
    lean = GPipe(untracked, [8, 8], chunks=4, track_memory=False)
    assert_close(lean.train_step(x, target, F.mse_loss), loss)
    for a, b in zip(tracked.parameters(), untracked.parameters()):
        assert_close(a.grad, b.grad)
    assert lean.timeline.peak_memory == [0, 0]


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_stage_may_start_with_an_in_place_layer(schedule: str, checkpoint: str) -> None:
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.LeakyReLU(inplace=True)
        ).double()

    x = torch.randn(6, 4, dtype=torch.float64)
    target = torch.randn(6, 4, dtype=torch.float64)
    _, expected_loss, expected_grads, _ = reference_step(build(), x, target, F.mse_loss)
    model = build()
    pipe = GPipe(model, [1, 2, 1], chunks=3, schedule=schedule, checkpoint=checkpoint)
    assert_close(pipe.train_step(x, target, F.mse_loss), expected_loss)
    for param, grad in zip(model.parameters(), expected_grads):
        assert_close(param.grad, grad)


def test_timeline_events_read_as_kind_microbatch_start_end() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    pipe.train_step(
        torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64), F.mse_loss
    )
    first = pipe.timeline.events[1][0]
    assert (first.kind, first.stage, first.microbatch) == ("F", 1, 0)
    assert 0 <= first.start < first.end <= pipe.timeline.makespan + pipe.timeline.start


def test_a_loss_class_passed_for_a_loss_is_told_to_pass_an_instance() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"loss_fn is the class MSELoss.*loss_fn=MSELoss\(\)"):
        pipe.train_step(x, x, nn.MSELoss)  # type: ignore[arg-type]


def test_more_chunks_than_samples_warns_once_naming_the_micro_batches_run() -> None:
    pipe = GPipe(make_mlp(2), [2, 2], chunks=8)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"chunks=8 but the batch has 4 samples: .* runs 4 "):
        pipe.train_step(x, x, F.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per pipe
        pipe.train_step(x, x, F.mse_loss)
        GPipe(make_mlp(2), [2, 2], chunks=4).train_step(x, x, F.mse_loss)  # enough samples


def test_a_model_built_on_meta_is_refused_in_gpipes_words() -> None:
    with torch.device("meta"):
        model = make_mlp(2)
    with pytest.raises(ValueError, match=r"on the meta device.*to_empty.*DistributedGPipe"):
        GPipe(model, [2, 2], chunks=2)


def test_a_model_that_is_not_a_sequential_is_pointed_to_gpipe_split() -> None:
    class Residual(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x

    with pytest.raises(TypeError, match=r"got Residual.*gpipe\.split\(model, split_points"):
        GPipe(Residual(), chunks=2)  # type: ignore[arg-type]


def test_too_few_devices_is_a_public_error_that_counts_in_words() -> None:
    from gpipe.local_layout import DeviceCountError

    with pytest.raises(
        DeviceCountError, match=r"balance lists 2 stages but devices lists 1 device "
    ):
        GPipe(make_mlp(2), [2, 2], devices=["cpu"], chunks=2)
    assert issubclass(DeviceCountError, ValueError) and issubclass(DeviceCountError, IndexError)
