"""The stage worker: runs one device's actions (forward, backward, weight gradient)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpipe.analysis import Event
from gpipe.batchnorm import recomputing
from gpipe.checkpoint import checkpointed
from gpipe.randomness import LOSS_KEY
from gpipe.randomness.streams import GeneratorStates
from gpipe.runtime.copies import GpuClock
from gpipe.runtime.saved import SavedBytes, gradient_bytes, storage_keys, tensor_bytes
from gpipe.runtime.split_backward import backward_input, backward_weight
from gpipe.runtime.stages import StageSet
from gpipe.runtime.state import Saved, StepState
from gpipe.runtime.transport import ACTIVATION, GRADIENT, Transport
from gpipe.schedule import BACKWARD, FORWARD, Action
from gpipe.structure import leaves, map_tensors

__all__ = ["StageWorker"]

_ENGINE: Any = torch.autograd.Variable._execution_engine


def _as_leaves(value: Any) -> Any:
    """Cut ``value``'s tensors from any graph, keeping whether they need a gradient.

    A tensor that already is a leaf stays as it is. NOTE: a message is a leaf made for its
    receiver alone (``to_stage``, ``_for_next_stage``; without autograd, the sender's output,
    which the sender does not keep) unless the transport moved it to another device;
    detaching it again cost a detach and a freed tensor per forward, both calls that release
    the GIL.
    """
    return map_tensors(
        lambda t: t if t.is_leaf else t.detach().requires_grad_(t.requires_grad), value
    )


def _kept_bytes(inputs: Any) -> int:
    """What a checkpointed micro-batch keeps: its stage input, by the counter's rule."""
    if isinstance(inputs, torch.Tensor):  # the common case, on every checkpointed forward
        return tensor_bytes(inputs)
    counter = SavedBytes()
    counter.keep(inputs)
    return counter.nbytes


def _chained(counter: SavedBytes) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The counter's saved-tensor hooks, handing each tensor on to the caller's own hooks.

    NOTE: hooks do not stack, so the counter's would replace the caller's (``save_on_cpu``).
    And compiled code calls the hooks too: Dynamo would compile them as frames of their own,
    so it is told to leave them alone, once it is loaded (importing it takes seconds, and
    nothing is compiled before).
    """
    pack: Callable[[Any], Any] = counter.pack
    unpack: Callable[[Any], Any] = counter.unpack
    outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if outer is not None:
        outer_pack, unpack = outer

        def pack(tensor: torch.Tensor) -> Any:
            return outer_pack(counter.pack(tensor))

    if "torch._dynamo" in sys.modules:
        pack, unpack = torch.compiler.disable(pack), torch.compiler.disable(unpack)
    return pack, unpack


def _for_next_stage(value: Any) -> Any:
    """Detach outputs for the next stage; floating tensors there need gradients."""
    # NOTE: the dtype's flags, not t.is_floating_point(): that call releases the GIL, and each
    # release lets another worker's thread wake up for nothing.
    return map_tensors(
        lambda t: t.detach().requires_grad_(t.dtype.is_floating_point or t.dtype.is_complex),
        value,
    )


def _shapes(value: Any) -> tuple[Any, ...]:
    """What the bytes a forward saves depend on: each tensor's shape, dtype and grad flag."""
    if isinstance(value, torch.Tensor):  # NOTE: the common case, twice per forward
        return ((value.shape, value.dtype, value.requires_grad),)
    return tuple(
        (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else leaf
        if isinstance(leaf, (int, float, bool, str, type(None)))
        else type(leaf)
        for leaf in leaves(value)
    )


def _versions(value: Any) -> Any:
    """The version counters of ``value``'s tensors: an in-place write bumps its tensor's.

    Views share their base's counter, so a write through a view of an input shows too.
    (Inference tensors have none; nothing can be saved from them for a backward either.)
    A lone tensor, the common case on every forward, skips the tree walk.
    """
    if isinstance(value, torch.Tensor):
        # NOTE: asking first (value.is_inference()) is a call that releases the GIL, twice per
        # forward; an inference tensor's _version raises instead.
        try:
            return value._version
        except RuntimeError:
            return None
    return [_versions(leaf) for leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


def _backward(roots: list[tuple[Any, torch.Tensor | None]], retain_graph: bool) -> None:
    """``torch.autograd.backward`` of ``roots`` (output, its gradient or None for a scalar).

    NOTE: for plain tensors this goes to the autograd engine directly: the Python wrapper
    around it (argument checks, a gradient made for each scalar, a context stashed for the
    engine's device threads, which a worker never uses: it runs its backward itself) cost
    about 15 us per backward, on every stage's every backward. The engine still checks each
    gradient against its output (shape, dtype, device). Anything else (a tensor subclass, a
    non-scalar output without a gradient) takes the wrapper, which handles and explains it.
    """
    outputs, grads = [], []
    for output, grad in roots:
        if type(output) is not torch.Tensor or not (
            type(grad) is torch.Tensor or (grad is None and output.dim() == 0)
        ):
            torch.autograd.backward(
                [r for r, _ in roots], [g for _, g in roots], retain_graph=retain_graph
            )
            return
        outputs.append(output)
        grads.append(torch.ones_like(output) if grad is None else grad)
    _ENGINE.run_backward(
        tuple(outputs),
        tuple(grads),
        retain_graph,
        False,  # create_graph
        (),  # inputs: every leaf
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _copy(value: Any) -> Any:
    return map_tensors(torch.Tensor.clone, value)


def _grad_leaves(value: Any) -> list[torch.Tensor | None]:
    """The flattened leaves of ``value``, with None for those that take no gradient."""
    return [
        leaf if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
        for leaf in leaves(value)
    ]


class StageWorker:
    """Runs the actions of one device in one step, on that device's stages.

    Forward (F) receives the stage input, runs the stage (without autograd when the
    micro-batch is checkpointed), keeps what the backward needs and sends the output on.
    Backward (B) receives the output gradient, recomputes the forward if it was
    checkpointed, and sends the input gradient back; it also computes weight gradients
    unless the schedule runs them as separate W actions.

    Args:
        stages: the stage modules and their placement.
        device: the pipeline device whose actions this worker runs.
        transport: what carries messages to and from the other stages.
        state: the step being run.
    """

    def __init__(
        self, stages: StageSet, device: int, transport: Transport, state: StepState
    ) -> None:
        self.stages = stages
        self.device = device
        self.transport = transport
        self.state = state
        self.torch_device = stages.devices[device]
        self.routes = stages.routes
        self.events: list[Event] = state.events[device]
        self._last = stages.last
        self.held = 0  # bytes this device holds for backward right now
        self._params: dict[int, set[int]] = {}
        self._trainables: dict[int, list[torch.Tensor]] = {}
        self._redone = False  # whether the last _run redid its forward (see _run)
        # The default generators' states as this worker's last forward left them, within
        # one run (see StageForward): between runs the caller may draw.
        self._watched: GeneratorStates | None = None
        self._autocast_restored: Callable[[], AbstractContextManager[None]] | None = None
        self._autocast_key: tuple[Any, ...] = ()  # the forward's autocast, in saved_bytes keys
        # On a GPU, each action's start and end are CUDA events on its stream, read when the
        # timeline is (StepState.settle), by a clock started as its run began (a new one for
        # each run: pipe(x), then loss.backward(), are two runs of one step).
        self._clock: GpuClock | None = None
        self._started: Any = None

    def entered(self) -> contextlib.ExitStack:
        """The state a run's actions run in: the caller's, this worker's device, and
        autograd's multithreading off (entered by the lane that runs this worker).

        NOTE: with autograd's multithreading off, this thread runs its backward's every node
        itself, whatever their device. Otherwise the engine hands a GPU's nodes to its one
        thread for that GPU, and ``pipe(x)`` then ``loss.backward()`` would hang: the engine
        runs the pipe's own backward node (:class:`~gpipe.runtime.caller.PipelineBackward`)
        on that very thread, which waits there for the other workers' gradients.
        """
        stack = contextlib.ExitStack()
        if self.state.context is not None:
            stack.enter_context(self.state.context.entered())
        if self.torch_device.type == "cuda":
            stack.enter_context(torch.cuda.device(self.torch_device))
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        return stack

    def prepare(self) -> None:
        """Start a run: what this worker decides once per run, inside :meth:`entered`."""
        context = self.state.context
        self._watched = None
        # NOTE: decided once per run: a recomputation needs the forward's autocast entered
        # only when this run's differs (pipe(x) under autocast, loss.backward() outside).
        forward = self.state.forward_context
        self._autocast_key = forward.autocast_key if forward is not None else ()
        self._autocast_restored = (
            None
            if forward is None
            or (
                context is not None
                and (forward.autocast, forward.autocast_cache)
                == (context.autocast, context.autocast_cache)
            )
            else forward.autocast_restored
        )
        if self.torch_device.type == "cuda":
            self._clock = GpuClock(self.torch_device)
            self._clock.start()

    def perform(self, action: Action) -> None:
        """Run one action; an error it raises is marked with the action."""
        try:
            if action.kind == FORWARD:
                self.forward(action)
            elif action.kind == BACKWARD:
                self.backward(action)
            else:
                self.weight(action)
            after = self.state.after
            if after is not None:
                after(action)
        except Exception as exc:
            exc.gpipe_action = action  # type: ignore[attr-defined]
            raise

    # -- the three actions -------------------------------------------------------------

    def forward(self, action: Action) -> None:
        step, stage, mb = self.state, action.stage, action.microbatch
        routes = self.routes
        if routes is None:
            inputs = self.transport.recv((ACTIVATION, stage, mb))
        else:
            inputs = routes.receive(self.transport, stage, mb)
        start = self._begin()
        inputs = _as_leaves(inputs)
        key = (stage, self.stages.module(stage).training)
        writes = self.stages.copies_input.get(key)
        # NOTE: a stage input may be the caller's batch (stage 0), views sharing one version
        # counter with the other micro-batches, or what a checkpointed micro-batch recomputes
        # from; a stage that writes into it gets a copy. Whether it does is learned from its
        # first forward in each mode, run on a copy so nothing is written before we know.
        # In a dataflow a value may also be read by several stages at once: always a copy.
        copied = writes is None or (writes and (step.grad or stage == 0 or routes is not None))
        given = inputs
        if copied:
            with torch.set_grad_enabled(step.grad):  # the copy joins the graph to the input
                given = _copy(inputs)
        before = _versions(given)
        source = inputs if copied else None
        if not step.grad:
            with torch.no_grad():
                output, _ = self._run(stage, mb, given, source)
            self._learn_writes(key, before, given, copied, harmless=True)
            if routes is None:
                self.transport.send((ACTIVATION, stage + 1, mb), output)
            else:
                routes.send(self.transport, stage, mb, output, None)
            self._record(action, start)
            return
        if checkpointed(step.checkpoint, mb, step.microbatches):
            with torch.no_grad():
                output, root = self._run(stage, mb, given, source)
            kept = _kept_bytes(inputs) if step.track_memory else 0
            saved = Saved(inputs, None, kept)
        else:
            output, root, kept = self._forward_kept(stage, mb, given, source)
            saved = Saved(inputs, output if root is None else root, kept)
        self._learn_writes(key, before, given, copied, harmless=False)
        step.saved[stage, mb] = saved
        self.held += saved.nbytes
        if routes is not None:
            if root is None:
                routes.send(self.transport, stage, mb, output, _for_next_stage)
            elif stage != routes.last:
                routes.check_output(stage, output)
        elif root is None:
            self.transport.send((ACTIVATION, stage + 1, mb), _for_next_stage(output))
        self._record(action, start)

    def backward(self, action: Action) -> None:
        step, stage, mb = self.state, action.stage, action.microbatch
        saved = step.saved[stage, mb]
        has_loss = step.loss is not None and stage == self._last
        routes = self.routes
        if has_loss:
            grads = None
        elif routes is None:
            grads = self.transport.recv((GRADIENT, stage, mb))
        else:
            messages = routes.receive_gradients(self.transport, stage, mb)
            grads = [g for _, message in messages for g in message]
        start = self._begin()
        recomputed = 0  # bytes the recomputation keeps beyond the stashed input
        if saved.outputs is None:  # re-materialize: same inputs, same random streams
            key = (stage, self.stages.module(stage).training)
            given, source = saved.inputs, None
            if self.stages.copies_input.get(key, True):
                with torch.enable_grad():  # NOTE: a backward runs with grad mode off
                    given, source = _copy(given), saved.inputs
            restore = self._autocast_restored  # recompute under the forward's autocast
            with recomputing(), restore() if restore else contextlib.nullcontext():
                output, root, kept = self._forward_kept(stage, mb, given, source)
            saved.outputs = output if root is None else root
            recomputed = kept - saved.nbytes
        if grads is None:
            # NOTE: a micro-batch of loss weight 0 adds nothing: no root, not 0 x its loss,
            # which may be nan (a mean over no tokens) and would poison every gradient
            weightless = step.loss is not None and not step.loss.weights[mb]
            roots: list[tuple[Any, torch.Tensor | None]]
            roots = [] if weightless else [(saved.outputs, None)]
        elif routes is not None:
            roots = routes.roots(saved.outputs, messages)
        else:
            roots = [
                (out, grad)
                for out, grad in zip(leaves(saved.outputs), grads)
                if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad
            ]
        inputs = _grad_leaves(saved.inputs)
        wanted = [leaf for leaf in inputs if leaf is not None]
        if step.split_backward:
            try:
                found, saved.weight = backward_input(roots, wanted, self._trainable(stage))
            except RuntimeError as error:
                if "donated buffers" not in str(error):
                    raise
                # NOTE: the split backward keeps the graph for W, which a compiled
                # backward that reuses ("donates") its saved buffers cannot allow
                raise RuntimeError(
                    "a torch.compile'd layer donates its saved buffers to its backward, "
                    "which a zero-bubble schedule runs in two parts (B, then W): set "
                    "torch._functorch.config.donated_buffer = False before the layers first "
                    "run, or use schedule='1f1b'"
                ) from error
        else:
            if roots:
                _backward(roots, step.retain_graph)
            found = [leaf.grad for leaf in wanted]
            for leaf in wanted:  # sent on below; a second backward must not add to it
                leaf.grad = None
        if routes is not None:
            routes.send_gradients(
                self.transport, stage, mb, saved.inputs, dict(zip(map(id, wanted), found))
            )
        elif stage > 0 or wanted:
            found_iter = iter(found)
            self.transport.send(
                (GRADIENT, stage - 1, mb),
                [None if leaf is None else next(found_iter) for leaf in inputs],
            )
        peak = self.held + recomputed
        if step.track_memory:
            received, sent = gradient_bytes(grads), gradient_bytes(found)
            peak += received + sent
            if saved.weight is not None:  # W needs the recomputed activations and gradients
                deferred = gradient_bytes([grads for _, grads, _ in saved.weight.parts])
                # NOTE: a stage whose input takes no gradient defers its whole backward,
                # keeping the very gradients it received: counted once.
                peak += deferred if wanted else max(0, deferred - received)
                saved.nbytes += recomputed + deferred
                self.held += recomputed + deferred
        if not step.split_backward:
            if step.retain_graph:
                self._retain(stage, mb, saved)
            else:
                self._release(stage, mb)
        self._record(action, start, peak)

    def weight(self, action: Action) -> None:
        step, stage, mb = self.state, action.stage, action.microbatch
        start = self._begin()
        weight = step.saved[stage, mb].weight
        if weight is not None:
            backward_weight(weight)
        peak = self.held
        self._release(stage, mb)
        self._record(action, start, peak)

    # -- pieces ------------------------------------------------------------------------

    def _forward_kept(
        self, stage: int, mb: int, inputs: Any, source: Any = None
    ) -> tuple[Any, Any, int]:
        """The forward under autograd, and the bytes it keeps for backward (0 untracked).

        The bytes are counted exactly, by a hook on every tensor autograd saves, the first
        time a stage sees inputs of a given shape (and mode); later forwards with the same
        shapes reuse the count. NOTE: the hook is a Python call per saved tensor, measured at
        5 % of a tiny GPT's step when run on every micro-batch. A model whose saved tensors
        change with the data itself (not its shape) is counted by its first micro-batch.
        """
        step = self.state
        known: int | None = 0
        if step.track_memory:
            module = self.stages.module(stage)
            target = _shapes(self._target(stage, mb))
            autocast = self._autocast_key
            key = (stage, module.training, _shapes(inputs), target, *autocast)
            known = self.stages.saved_bytes.get(key)
        if known is not None:
            self._redone = False
            with torch.enable_grad():
                output, root = self._run(stage, mb, inputs, source)
            if self._redone:  # a layer began to draw (and save a mask): count afresh
                del self.stages.saved_bytes[key]
            return output, root, known
        counter = SavedBytes(self._param_storages(stage), borrowed=self._target(stage, mb))
        counter.keep(inputs)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(*_chained(counter)):
            self._redone = False
            output, root = self._run(stage, mb, inputs, source)
        if not self._redone:  # a redone forward counted its first attempt too
            self.stages.saved_bytes[key] = counter.nbytes
        return output, root, counter.nbytes

    def _target(self, stage: int, mb: int) -> Any:
        """The loss target of micro-batch ``mb`` if ``stage`` computes the loss, else None."""
        loss = self.state.loss
        if loss is None or stage != self._last:
            return None
        return loss.targets[mb]

    def _run(
        self, stage: int, mb: int, inputs: Any, source: Any = None
    ) -> tuple[Any, torch.Tensor | None]:
        """The stage's forward, and on the last stage of train_step the weighted loss.

        Each layer (and the loss) draws from its own (layer, micro-batch) random stream. If a
        layer drew off its stream (it began to draw, or its draws bypass routing), the
        forward is redone on the streams before anything leaves it, on a fresh copy of
        ``source`` if ``inputs`` is a copy of it (the first attempt may have written into it).
        """
        step = self.state
        module: Any = self.stages.module(stage)
        keys, layered = self.stages.keys[stage]
        loss = step.loss if stage == self._last else None
        streams = self.stages.streams.forward(
            [*keys, *([LOSS_KEY] if loss is not None else [])],
            device=self.device,
            training=module.training,
            step_seed=step.seed,
            microbatch=mb + step.microbatch_offset,
            stage=stage,
            watched=self._watched,
        )
        self._watched = None  # until this forward settles

        def call(given: Any) -> tuple[Any, torch.Tensor | None]:
            if layered:
                scope = streams.layer_scope
                # NOTE: nn.Module.__setattr__ is slow, and twice per forward it showed
                if scope is None:  # every layer runs as it is: the common case
                    output = module(given)
                else:
                    module.layer_scope = scope
                    try:
                        output = module(given)
                    finally:
                        module.layer_scope = None
            else:  # NOTE: a dataflow's stage module draws from one stream as a whole
                with streams.scope(keys[0]):
                    output = module(given)
            if loss is None:
                return output, None
            with streams.scope(LOSS_KEY):
                value = loss.fn(output, loss.targets[mb])
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"loss_fn must return a tensor (the scalar to differentiate), got "
                    f"{type(value).__name__} {value!r}: return the loss itself, not "
                    "float(loss) or loss.item()"
                )
            step.losses[mb] = value.detach()
            return output, value * loss.weights[mb]

        streams.attempt()
        result = call(inputs)
        while not streams.settled():
            self._redone = True
            streams.attempt()
            with recomputing():  # NOTE: batch statistics count once
                result = call(inputs if source is None else _copy(source))
        self._watched = streams.watched
        return result

    def _learn_writes(
        self, key: tuple[int, bool], before: Any, given: Any, copied: bool, harmless: bool
    ) -> None:
        """Note whether the forward just run wrote into its input (``given``).

        A stage whose earlier forwards in this mode did not write ran on the input itself:
        a write now (an in-place op that only some inputs trigger) may have changed what a
        checkpointed micro-batch recomputes from, so the step stops. Without autograd
        (``harmless``) nothing is kept that the write could spoil.
        """
        if before is None or (isinstance(before, list) and None in before):
            return  # inference tensors keep no version: this forward cannot tell
        wrote = _versions(given) != before
        known = self.stages.copies_input.get(key)
        if known is None or (wrote and not known):
            self.stages.copies_input[key] = wrote
        if wrote and not copied and not harmless:
            raise RuntimeError(
                f"stage {key[0]} wrote into its input in place, though its first forward "
                f"in {'training' if key[1] else 'eval'} mode did not (an in-place op that "
                "only some inputs trigger), so this step may have recomputed from a changed "
                "input and was stopped. gpipe copies this stage's input from now on: run "
                "the step again"
            )

    def _release(self, stage: int, mb: int) -> None:
        saved = self.state.saved.pop((stage, mb))
        self.held -= saved.nbytes

    def _retain(self, stage: int, mb: int, saved: Saved) -> None:
        """Keep the micro-batch for another backward (``retain_graph=True``), as it was.

        A checkpointed micro-batch drops its recomputed graph again, so between backwards
        it holds only its input, as before the first.
        """
        if checkpointed(self.state.checkpoint, mb, self.state.microbatches):
            saved.outputs = None

    def _trainable(self, stage: int) -> list[torch.Tensor]:
        """The stage's parameters that take gradients, listed once per step."""
        if stage not in self._trainables:
            params = self.stages.parameters(stage)
            self._trainables[stage] = [p for p in params if p.requires_grad]
        return self._trainables[stage]

    def _param_storages(self, stage: int) -> set[int]:
        """Where the stage's parameters and buffers live: not activations, never counted."""
        if stage not in self._params:
            module = self.stages.module(stage)
            params = self.stages.parameters(stage)
            self._params[stage] = storage_keys([*params, *module.buffers()])
        return self._params[stage]

    def _begin(self) -> int:
        """Mark an action's start: now, and on a GPU when its stream gets here."""
        if self._clock is not None:
            self._started = self._clock.mark()
        return time.perf_counter_ns()

    def _record(self, action: Action, start_ns: int, memory: int | None = None) -> None:
        """Add the action to the timeline, its times from this thread's clock; on a GPU,
        with its events, which replace them when the timeline is read.

        NOTE: no wait for the GPU here: the next action is queued while this one runs.
        """
        origin = self.state.origin_ns
        end_ns = time.perf_counter_ns()
        if self._clock is not None:
            marks = (self._clock, self._started, self._clock.mark())
            self.state.timed.append((self.device, len(self.events), *marks))
        self.events.append(
            Event(
                action,
                (start_ns - origin) / 1e9,
                (end_ns - origin) / 1e9,
                self.held if memory is None else memory,
            )
        )
