"""One rule for the bytes autograd keeps, the same in the runtime and in the profiler."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from gpipe import GPipe
from gpipe.balance import profile
from gpipe.runtime.saved import SavedBytes, storage_keys, tensor_bytes

ROWS, WIDTH = 4, 6
FLOAT64 = 8


class Narrow(nn.Module):
    """Keeps the first WIDTH columns of a 4x wider activation: a mul saves that view."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(WIDTH, 4 * WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x)[:, :WIDTH] * self.scale


def saved_by(fn, *args: torch.Tensor, **kwargs) -> int:  # type: ignore[no-untyped-def]
    counter = SavedBytes(**kwargs)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        fn(*args)
    return counter.nbytes


def test_a_saved_view_counts_its_whole_storage_once() -> None:
    wide = torch.randn(ROWS, 4 * WIDTH, requires_grad=True)
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        y = wide * 2.0
        outputs = [y[:, :WIDTH].sin(), y[:, WIDTH:].cos()]  # each saves a view into y
    assert counter.nbytes == ROWS * 4 * WIDTH * 4  # y once, whole (float32)
    assert [tuple(o.shape) for o in outputs] == [(ROWS, WIDTH), (ROWS, 3 * WIDTH)]


def test_parameters_count_nothing_and_kept_inputs_count_their_own_bytes() -> None:
    layer = nn.Linear(WIDTH, WIDTH)
    batch = torch.randn(3 * ROWS, WIDTH)
    microbatch = batch[ROWS : 2 * ROWS]  # a view into the caller's batch
    counter = SavedBytes(storage_keys(layer.parameters()))
    counter.keep(microbatch)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        layer(microbatch.requires_grad_())  # saves its input and its weight
    assert counter.nbytes == tensor_bytes(microbatch) == ROWS * WIDTH * 4


def test_a_borrowed_target_counts_its_own_bytes_only_if_saved() -> None:
    targets = torch.randn(3 * ROWS, WIDTH)
    target = targets[:ROWS]
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    saved = saved_by(lambda: F.mse_loss(x * 1.0, target), borrowed=target)
    # mse saves its input (a new tensor) and the target: its rows, not the whole targets
    assert saved == tensor_bytes(x) + tensor_bytes(target) < tensor_bytes(x) + targets.nbytes
    assert saved_by(lambda: (x * 1.0).sum(), borrowed=target) == 0


def test_tensors_without_a_readable_storage_count_their_own_bytes_without_warning() -> None:
    sparse = torch.randn(5, 5).relu().to_sparse()
    assert tensor_bytes(sparse) == sparse._indices().nbytes + sparse._values().nbytes
    meta = torch.empty(3, 4, device="meta")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FakeTensor warns when its data pointer is read
        counter = SavedBytes()
        for tensor in (sparse, meta, fake, fake):
            counter.pack(tensor)
    assert counter.nbytes == tensor_bytes(sparse) + 3 * 4 * 4 + 2 * 8 * 4


def test_runtime_and_profiler_count_a_saved_view_alike() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Narrow(), nn.Tanh(), Narrow(), nn.Tanh()).double()
    x = torch.randn(2 * ROWS, WIDTH, dtype=torch.float64)
    pipe = GPipe(model, [2, 2], chunks=2, checkpoint="never")
    pipe.train_step(x, torch.randn(2 * ROWS, WIDTH, dtype=torch.float64), F.mse_loss)
    forward = pipe.timeline.events[0][0]
    assert str(forward.action) == "0F0"
    # the stage input, the whole wide activation the mul's view keeps alive, the Tanh output
    expected = ROWS * (WIDTH + 4 * WIDTH + WIDTH) * FLOAT64
    assert forward.memory == expected
    measured = profile(model, x[:ROWS], repeats=1, warmup=0)
    assert measured.stage_activation_bytes(0, 2) == expected
