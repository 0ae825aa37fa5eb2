"""The caller's thread-local state reaches every stage, as if the model ran on its thread."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from conftest import make_mlp
from gpipe import GPipe
from gpipe.microbatch import scatter

X = torch.linspace(-1, 1, 8 * 6, dtype=torch.float64).view(8, 6)
TARGET = torch.zeros(8, 6, dtype=torch.float64)
DEVICE_THREADS = {"MainThread", "gpipe-device1", "gpipe-device2"}


def _microbatched(model: nn.Module, chunks: int) -> torch.Tensor:
    """Plain training over the micro-batches, with the pipe's loss weights."""
    total = torch.zeros((), dtype=torch.float64)
    for x, target in zip(scatter(X, chunks), scatter(TARGET, chunks)):
        total = total + F.mse_loss(model(x), target) * (len(x) / len(X))
    total.backward()
    return total.detach()


class _CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that count, per thread, the tensors autograd packs."""

    def __init__(self) -> None:
        self.packed: Counter[str] = Counter()
        self.unpacked = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.packed[threading.current_thread().name] += 1
        return ("packed", tensor.clone())

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.unpacked += 1
        return packed[1]


@pytest.mark.parametrize("track_memory", [True, False])
def test_saved_tensor_hooks_of_the_caller_pack_on_every_stage(track_memory: bool) -> None:
    plain = make_mlp(3)
    expected = _CountingHooks()
    with expected:
        _microbatched(plain, 4)
    model = make_mlp(3)
    pipe = GPipe(model, [2, 2, 2], chunks=4, checkpoint="never", track_memory=track_memory)
    hooks = _CountingHooks()
    with hooks:
        loss = pipe.train_step(X, TARGET, F.mse_loss)
    assert set(hooks.packed) == DEVICE_THREADS
    assert hooks.packed.total() == expected.packed.total() == hooks.unpacked
    assert_close(loss, F.mse_loss(plain(X), TARGET))
    assert_close([p.grad for p in model.parameters()], [p.grad for p in plain.parameters()])


def test_save_on_cpu_offloads_on_every_stage_of_pipe_call() -> None:
    model = make_mlp(3)
    pipe = GPipe(model, [2, 2, 2], chunks=2, checkpoint="except_last")
    hooks = _CountingHooks()
    with hooks:
        out = pipe(X)
    F.mse_loss(out, TARGET).backward()
    assert set(hooks.packed) == DEVICE_THREADS
    with torch.autograd.graph.save_on_cpu():
        pipe.train_step(X, TARGET, F.mse_loss)  # the real thing runs on every stage too


def test_flop_counter_counts_every_stage() -> None:
    plain = make_mlp(4)
    with FlopCounterMode(display=False) as expected:
        F.mse_loss(plain(X), TARGET).backward()
    pipe = GPipe(make_mlp(4), [2, 2, 2, 2], chunks=4, checkpoint="never")
    with FlopCounterMode(display=False) as counter:
        pipe.train_step(X, TARGET, F.mse_loss)
    assert counter.get_total_flops() == expected.get_total_flops() > 0


class _OpLog(TorchDispatchMode):
    """Records, per thread, the ops that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with self._lock:
            self.ops[threading.current_thread().name, str(func)] += 1
        return func(*args, **(kwargs or {}))

    def count(self, op: str) -> int:
        return sum(n for (_, name), n in self.ops.items() if name == op)


def test_a_dispatch_mode_of_the_caller_sees_every_stages_ops() -> None:
    with _OpLog() as expected:
        _microbatched(make_mlp(3, dropout=0.5), 2)
    pipe = GPipe(make_mlp(3, dropout=0.5), [3, 3, 3], chunks=2, checkpoint="never")
    with _OpLog() as log:
        pipe.train_step(X, TARGET, F.mse_loss)
    assert {thread for thread, _ in log.ops} == DEVICE_THREADS
    for op in ["aten.addmm.default", "aten.tanh.default", "aten.mm.default"]:
        assert log.count(op) == expected.count(op) > 0, op
    # dropout's draws reach the user's mode, handed the layer's own generator
    assert log.count("aten.bernoulli_.float") == expected.count("aten.bernoulli_.float") == 6


class _FunctionLog(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.threads: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.linear:
            self.threads[threading.current_thread().name] += 1
        return func(*args, **(kwargs or {}))


def test_a_function_mode_of_the_caller_sees_every_stages_calls() -> None:
    pipe = GPipe(make_mlp(3), [2, 2, 2], chunks=2)
    with _FunctionLog() as log:
        pipe.train_step(X, TARGET, F.mse_loss)
    assert set(log.threads) == DEVICE_THREADS
    # every layer and micro-batch, and micro-batch 0 once more, recomputed
    assert log.threads.total() == 3 * 2 + 3


def test_no_grad_and_inference_mode_behave_as_in_plain_pytorch() -> None:
    model = make_mlp(3)
    pipe = GPipe(model, [2, 2, 2], chunks=2)
    x = X.clone().requires_grad_()
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad and out.grad_fn is None
    with torch.inference_mode():
        out = pipe(x)
        expected = model(x)
    assert out.is_inference() and expected.is_inference()
    assert_close(out, expected)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="train_step needs autograd"):
        pipe.train_step(X, TARGET, F.mse_loss)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_train_step_under_autocast_computes_the_loss_under_it(checkpoint: str) -> None:
    """Loss and gradients as ``with autocast: loss = loss_fn(model(x), y)``, dtype included."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 8))
    x, target = torch.randn(16, 8), torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.mse_loss(plain(x), target)
    expected.backward()
    twin = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 8))
    twin.load_state_dict(plain.state_dict())
    pipe = GPipe(twin, [2, 1, 1], chunks=2, checkpoint=checkpoint)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.train_step(x, target, F.mse_loss)
    assert loss.dtype == expected.dtype == torch.float32
    assert_close(loss, expected.detach(), rtol=2e-2, atol=1e-2)
    for ours, theirs in zip(twin.parameters(), plain.parameters()):
        assert ours.grad.dtype == theirs.grad.dtype == torch.float32
        assert_close(ours.grad, theirs.grad, rtol=5e-2, atol=2e-2)


def test_recomputation_runs_under_the_forwards_autocast() -> None:
    """pipe(x) under autocast, backward outside it: the recomputation is cast as the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    kept = GPipe(model, [1, 1, 1], chunks=2, checkpoint="never")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kept(x)
    out.float().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    recomputed = GPipe(model, [1, 1, 1], chunks=2, checkpoint="always")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = recomputed(x)
    out.float().sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
