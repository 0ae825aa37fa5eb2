"""Worker threads: one per device, kept from step to step, ending with their pipe."""

from __future__ import annotations

import copy
import gc
import pickle
import threading
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import make_mlp, reference_step
from gpipe import GPipe
from gpipe.runtime.threads import DeviceThreads


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gpipe-")}


def _step(pipe: GPipe) -> torch.Tensor:
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    return pipe.train_step(x, target, F.mse_loss)


def test_a_pipe_keeps_one_thread_per_device_but_the_callers_across_steps() -> None:
    pipe = GPipe(make_mlp(), [4, 4, 8], chunks=4)
    _step(pipe)
    first = _workers()
    _step(pipe)
    assert _workers() == first
    assert sorted(t.name for t in first) == ["gpipe-device1", "gpipe-device2"]
    pipe.close()


def test_the_threads_end_when_the_pipe_is_garbage_collected() -> None:
    pipe = GPipe(make_mlp(), [8, 8], chunks=4)
    _step(pipe)
    (thread,) = _workers()
    del pipe
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_close_ends_the_threads_and_a_later_step_starts_new_ones_that_train_alike() -> None:
    torch.manual_seed(0)
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    model = make_mlp()
    pipe = GPipe(model, [8, 8], chunks=4)
    before = pipe.train_step(x, target, F.mse_loss)
    grads = [p.grad.clone() for p in model.parameters()]
    old = _workers()
    pipe.close()
    assert not any(t.is_alive() for t in old)
    model.zero_grad()
    after = pipe.train_step(x, target, F.mse_loss)
    assert _workers() and not _workers() & old
    torch.testing.assert_close(after, before)
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(param.grad, grad)
    pipe.close()


def test_a_copy_of_the_threads_starts_with_none_of_its_own() -> None:
    threads = DeviceThreads()
    ran: list[str] = []
    threads.submit(1, lambda: ran.append(threading.current_thread().name)).wait()
    assert ran == ["gpipe-device1"]
    for twin in (copy.deepcopy(threads), pickle.loads(pickle.dumps(threads))):
        twin.submit(1, lambda: ran.append("twin")).wait()
        twin.close()
    assert ran == ["gpipe-device1", "twin", "twin"]
    assert len(_workers()) == 1
    threads.close()
    assert not _workers()


@pytest.mark.timeout(30)
def test_a_thread_that_cannot_start_fails_the_step_without_leaving_a_worker_blocked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_mlp()
    pipe = GPipe(model, [4, 4, 8], chunks=4)
    submit = DeviceThreads.submit

    def fail_on_device2(self: DeviceThreads, device: int, work: Any) -> Any:
        if device == 2:
            raise RuntimeError("can't start new thread")
        return submit(self, device, work)

    monkeypatch.setattr(DeviceThreads, "submit", fail_on_device2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        _step(pipe)  # device 1 started and waits for device 2's messages: it must be woken
    monkeypatch.undo()
    model.zero_grad(set_to_none=True)  # the failed step may have left partial gradients
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    _, expected, grads, _ = reference_step(make_mlp(), x, target, F.mse_loss)
    assert_close(pipe.train_step(x, target, F.mse_loss), expected)
    assert_close([p.grad for p in model.parameters()], grads)
    pipe.close()


def test_a_device_thread_runs_its_work_under_the_callers_torch_config_settings() -> None:
    # torch keeps a user's config settings per thread (per context): set in the caller, the
    # device threads must see them too, or advice such as "set donated_buffer = False"
    # would not reach the layers they run
    import torch._functorch.config as functorch_config

    threads = DeviceThreads()
    seen: list[bool] = []
    with functorch_config.patch(donated_buffer=False):
        threads.submit(1, lambda: seen.append(functorch_config.donated_buffer)).wait()
    threads.submit(1, lambda: seen.append(functorch_config.donated_buffer)).wait()
    threads.close()
    assert seen == [False, True]  # then torch's default again
