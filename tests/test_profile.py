"""Profiling: exact byte counts, positive times, odd layers, and the user's model left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.balance import Profile, profile
from gpipe.balance.optimizer_state import optimizer_state_factor

FLOAT = 4  # bytes per float32
LONG = 8  # bytes per int64


def quick(module: nn.Sequential, sample: object, **kwargs: object) -> Profile:
    return profile(module, sample, repeats=2, warmup=1, **kwargs)


class SplitPair(nn.Module):
    """Returns a tuple: the input and its row sums."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(dim=1)


class JoinPair(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, total = pair
        return x + total.unsqueeze(1)


class Square(nn.Module):
    """``x * x`` saves ``x`` twice; autograd keeps it once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class HalvesProduct(nn.Module):
    """Saves two views of one storage, which keep the whole storage alive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :5] * x[:, 5:]


class Argmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=1)


class ModeSpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return x


def test_output_bytes_are_the_returned_tensor_sizes() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20), SplitPair()), torch.randn(4, 10))
    assert measured.output_bytes == [4 * 20 * FLOAT, 4 * 20 * FLOAT + 4 * FLOAT]


def test_linear_saves_its_input_and_not_its_weight() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20)), torch.randn(4, 10))
    assert measured.activation_bytes == [4 * 10 * FLOAT]


def test_relu_saves_its_output() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20), nn.ReLU()), torch.randn(4, 10))
    assert measured.activation_bytes == [4 * 10 * FLOAT, 4 * 20 * FLOAT]


def test_a_storage_saved_twice_or_through_views_counts_once() -> None:
    measured = quick(nn.Sequential(Square(), HalvesProduct()), torch.randn(4, 10))
    assert measured.activation_bytes == [4 * 10 * FLOAT, 4 * 10 * FLOAT]


def test_parameter_bytes_are_exact() -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3, bias=False))
    measured = quick(model, torch.randn(4, 10))
    assert measured.parameter_bytes == [(10 * 20 + 20) * FLOAT, 0, 20 * 3 * FLOAT]
    assert measured.gradient_bytes == measured.parameter_bytes


def test_forward_and_backward_times_are_positive() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20), nn.Tanh()), torch.randn(4, 10))
    assert all(t > 0 for t in measured.forward)
    assert all(t > 0 for t in measured.backward)
    assert measured.costs("time") == [f + b for f, b in zip(measured.forward, measured.backward)]


@pytest.mark.parametrize(
    ("optimizer", "factor"),
    [
        (None, 0),
        ("sgd", 0),
        ("sgd-momentum", 1),
        ("adam", 2),
        ("AdamW", 2),
        (torch.optim.Adam, 2),
        (torch.optim.SGD, 0),
        (torch.optim.Adagrad, 1),
    ],
)
def test_optimizer_bytes_are_a_multiple_of_trainable_parameter_bytes(
    optimizer: object, factor: int
) -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 2))
    model[1].requires_grad_(False)  # frozen: no optimizer state, no gradient
    measured = quick(model, torch.randn(4, 10), optimizer=optimizer)
    assert optimizer_state_factor(optimizer) == factor
    assert measured.optimizer_bytes == [factor * 220 * FLOAT, 0]
    assert measured.gradient_bytes == [220 * FLOAT, 0]


def test_unknown_optimizer_is_rejected_with_the_accepted_names() -> None:
    with pytest.raises(ValueError, match="'adam'"):
        optimizer_state_factor("lamb")


def test_memory_cost_adds_parameters_gradients_optimizer_state_and_activations() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20)), torch.randn(4, 10), optimizer="adam")
    params = 220 * FLOAT
    assert measured.costs("memory") == [float(params + params + 2 * params + 4 * 10 * FLOAT)]
    assert measured.costs("params") == [float(params)]
    with pytest.raises(ValueError, match="'time', 'memory', 'params'"):
        measured.costs("flops")


def test_in_place_layer_is_profiled_without_touching_the_sample() -> None:
    sample = torch.tensor([[-1.0, 2.0], [3.0, -4.0]])
    measured = quick(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(2, 2)), sample)
    assert sample.tolist() == [[-1.0, 2.0], [3.0, -4.0]]
    assert measured.activation_bytes[0] == 2 * 2 * FLOAT
    assert measured.backward[0] > 0


def test_tuple_outputs_flow_to_the_next_layer_and_are_differentiated() -> None:
    model = nn.Sequential(nn.Linear(3, 5), SplitPair(), JoinPair(), nn.Linear(5, 1))
    measured = quick(model, torch.randn(4, 3))
    assert measured.layers == 4
    assert measured.output_bytes[2] == 4 * 5 * FLOAT
    assert all(t > 0 for t in measured.backward)


def test_embedding_on_integer_input_times_the_weight_gradient() -> None:
    tokens = torch.randint(0, 50, (4, 6))
    measured = quick(nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 2)), tokens)
    assert measured.backward[0] > 0
    assert measured.activation_bytes[0] == 4 * 6 * LONG  # the indices, not the table
    assert measured.parameter_bytes[0] == 50 * 8 * FLOAT


def test_non_differentiable_output_takes_no_backward_time() -> None:
    model = nn.Sequential(nn.Linear(4, 10), Argmax(), nn.Embedding(10, 3))
    measured = quick(model, torch.randn(5, 4))
    assert measured.backward[1] == 0.0
    assert measured.output_bytes[1] == 5 * LONG
    assert measured.backward[2] > 0


def test_profiling_leaves_gradients_modes_buffers_and_random_state_as_they_were() -> None:
    torch.manual_seed(0)
    spy = ModeSpy()
    norm = nn.BatchNorm1d(6)
    model = nn.Sequential(nn.Linear(3, 6), norm, nn.Dropout(0.5), spy, nn.Linear(6, 1))
    model.eval()
    model[1].train()
    kept = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = kept
    stats = norm.running_mean.clone()

    torch.manual_seed(1)
    quick(model, torch.randn(8, 3))
    after_profile = torch.rand(3)
    torch.manual_seed(1)
    torch.randn(8, 3)
    assert torch.equal(after_profile, torch.rand(3))

    assert spy.seen and all(spy.seen), "layers must run in train mode while profiled"
    assert [m.training for m in model] == [False, True, False, False, False]
    assert model[0].weight.grad is kept
    assert torch.equal(kept, torch.full_like(kept, 7.0))
    assert model[0].bias.grad is None and model[4].weight.grad is None
    assert torch.equal(norm.running_mean, stats)
    assert int(norm.num_batches_tracked) == 0


def test_table_lists_every_layer_and_a_total() -> None:
    measured = quick(nn.Sequential(nn.Linear(10, 20), nn.ReLU()), torch.randn(4, 10))
    lines = str(measured).splitlines()
    assert len(lines) == 4
    columns = ["layer", "forward", "backward", "output", "saved", "params", "optimizer"]
    assert lines[0].split() == columns
    assert lines[1].startswith("0 Linear") and "880 B" in lines[1]
    assert lines[2].startswith("1 ReLU") and lines[3].startswith("total")


@pytest.mark.parametrize(
    ("module", "sample", "error", "message"),
    [
        (nn.Linear(2, 2), torch.randn(1, 2), TypeError, r"nn.Sequential\(\*layers\)"),
        (nn.Sequential(), torch.randn(1, 2), ValueError, "at least one layer"),
        (nn.Sequential(nn.ReLU()), torch.randn(0, 2), ValueError, "non-empty batch"),
        (nn.Sequential(nn.ReLU()), None, ValueError, "non-empty batch"),
        (nn.Sequential(nn.ReLU()), [], ValueError, "non-empty batch"),
    ],
)
def test_bad_arguments_are_rejected_naming_the_fix(
    module: nn.Module, sample: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        profile(module, sample)


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), repeats=0)


def test_split_backward_measures_the_weight_gradient_part() -> None:
    from gpipe.models import SleepLayer

    layer = SleepLayer(forward_ms=1, backward_ms=20, weight_ms=10)
    measured = profile(nn.Sequential(layer), torch.randn(2, 3), repeats=3, split_backward=True)
    assert 0.005 < measured.weight[0] < 0.020  # about 10 ms of a 30 ms backward
    assert measured.backward[0] > 0.029
    assert profile(nn.Sequential(layer), torch.randn(2, 3), repeats=1).weight == []


def test_split_profile_measures_what_b_keeps_for_w() -> None:
    # W of a Linear resumes from the gradient of its output; Tanh has no parameters
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    measured = quick(model, torch.randn(4, 3), split_backward=True)
    assert measured.deferred_bytes == [4 * 5 * FLOAT, 0, 4 * 2 * FLOAT]
    assert quick(model, torch.randn(4, 3)).deferred_bytes == []
