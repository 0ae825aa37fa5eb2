"""The caller's thread-local state, carried into every worker thread of a step.

PyTorch keeps per thread what changes the meaning of ops: grad mode, inference mode, autocast,
the default saved-tensor hooks (``save_on_cpu``...), and the stacks of dispatch modes
(``FlopCounterMode``, user modes) and function modes (``torch.device(...)`` as a context,
``set_default_device``). A new thread starts without any of them, so a stage running on a
worker thread would silently run outside the caller's ``torch.autocast`` or
``FlopCounterMode``. The autograd engine meets the same problem for its device threads and
carries a snapshot of that state (``at::ThreadLocalState``) into them; a step does the same:
it captures the state once per run on the calling thread and re-enters it in each other
worker thread around that thread's actions, user modes outermost, as in the caller.

The caller's current CUDA stream of each GPU the pipe uses goes with it: every stage on a
GPU runs on that stream, so hand-offs between stages on one GPU, and between the caller and
the pipe, are ordered by the stream itself (see :mod:`gpipe.runtime.copies` for the rest).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["CallerContext", "recomputation_autocast", "worker_entered"]

Autocast = tuple[tuple[str, bool, torch.dtype], ...]


@dataclass(frozen=True)
class CallerContext:
    """A snapshot of one thread's state that changes what ops do.

    Args:
        thread: the ident of the thread it was captured on (which needs no re-entering).
        grad: grad mode.
        inference: inference mode.
        autocast: per device type: (device type, enabled, dtype).
        autocast_cache: whether autocast caches its casts of the weights.
        saved_tensors_hooks: the innermost default (pack, unpack) hooks, or None.
        hooks_disabled: the message ``disable_saved_tensors_hooks`` raises with, or None.
        dispatch_modes: the dispatch mode stack, outermost first.
        function_modes: the function mode stack, outermost first.
        streams: the current CUDA stream of each GPU the pipe uses.
    """

    thread: int
    grad: bool
    inference: bool
    autocast: Autocast
    autocast_cache: bool
    saved_tensors_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None
    hooks_disabled: str | None
    dispatch_modes: tuple[Any, ...]
    function_modes: tuple[Any, ...]
    streams: tuple[Any, ...] = ()

    @classmethod
    def capture(cls, devices: Iterable[torch.device]) -> CallerContext:
        """The calling thread's state, with autocast read for the types of ``devices`` and
        "cpu", and the current stream of each GPU among ``devices``."""
        devices = set(devices)
        kinds = sorted({device.type for device in devices} | {"cpu"})
        gpus = sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index or 0)
        return cls(
            thread=threading.get_ident(),
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=tuple(
                (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for kind in kinds
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
            saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(True),
            hooks_disabled=torch._C._autograd._saved_tensors_hooks_get_disabled_error_message(),
            dispatch_modes=tuple(_get_current_dispatch_mode_stack()),
            function_modes=tuple(_get_current_function_mode_stack()),
            streams=tuple(torch.cuda.current_stream(gpu) for gpu in gpus),
        )

    def autocast_only(self) -> CallerContext:
        """This snapshot's autocast alone, holding none of the caller's hooks or modes."""
        return dataclasses.replace(
            self, saved_tensors_hooks=None, dispatch_modes=(), function_modes=(), streams=()
        )

    @property
    def autocast_key(self) -> tuple[tuple[str, torch.dtype], ...]:
        """The autocast that is on, per device type: what changes a forward's saved bytes."""
        return tuple((kind, dtype) for kind, enabled, dtype in self.autocast if enabled)

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body under this state; on the thread it was captured on, as it is."""
        if threading.get_ident() == self.thread:
            yield
            return
        with ExitStack() as stack:
            # NOTE: entering a stream makes its GPU the current device until the exit
            for stream in self.streams:
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            for kind, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(
                        torch.autocast(kind, dtype=dtype, cache_enabled=self.autocast_cache)
                    )
            if self.hooks_disabled is not None:
                stack.enter_context(
                    torch.autograd.graph.disable_saved_tensors_hooks(self.hooks_disabled)
                )
            elif self.saved_tensors_hooks is not None:
                stack.enter_context(
                    torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks)
                )
            # NOTE: modes are pushed as they are, not entered: entering would run their
            # __enter__ again (FlopCounterMode's resets its counts).
            for function_mode in self.function_modes:
                torch._C._push_on_torch_function_stack(function_mode)
                stack.callback(torch._C._pop_torch_function_stack)
            for dispatch_mode in self.dispatch_modes:
                torch._C._push_on_torch_dispatch_stack(dispatch_mode)
                stack.callback(torch._C._pop_torch_dispatch_stack, None)
            yield

    @contextmanager
    def autocast_restored(self) -> Iterator[None]:
        """Run the body under this snapshot's autocast (a recomputation under the forward's)."""
        with ExitStack() as stack:
            for kind, enabled, dtype in self.autocast:
                now = torch.is_autocast_enabled(kind)
                if now != enabled or (enabled and torch.get_autocast_dtype(kind) != dtype):
                    stack.enter_context(
                        torch.autocast(
                            kind, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache
                        )
                    )
            yield


def worker_entered(caller: CallerContext | None, device: torch.device) -> ExitStack:
    """The state a worker's actions run in, entered now; the lane that runs them leaves it
    at the end of its ``with``: the caller's state (``caller``, if captured), ``device`` as
    the current GPU, and autograd's multithreading off.

    NOTE: with autograd's multithreading off, this thread runs its backward's every node
    itself, whatever their device. Otherwise the engine hands a GPU's nodes to its one
    thread for that GPU, and ``pipe(x)`` then ``loss.backward()`` would hang: the engine
    runs the pipe's own backward node (:class:`~gpipe.runtime.caller.PipelineBackward`)
    on that very thread, which waits there for the other workers' gradients.
    """
    stack = ExitStack()
    if caller is not None:
        stack.enter_context(caller.entered())
    if device.type == "cuda":
        stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.autograd.set_multithreading_enabled(False))
    return stack


def recomputation_autocast(
    forward: CallerContext | None, run: CallerContext | None
) -> Callable[[], AbstractContextManager[None]] | None:
    """What a recomputation in a run under ``run`` enters to run under the autocast of the
    run that did the forwards (``forward``); None where the two agree.

    NOTE: decided once per run: only a run whose autocast differs needs it entered
    (``pipe(x)`` under autocast, ``loss.backward()`` outside).
    """
    if forward is None or (
        run is not None
        and (forward.autocast, forward.autocast_cache) == (run.autocast, run.autocast_cache)
    ):
        return None
    return forward.autocast_restored
