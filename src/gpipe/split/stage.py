"""The stage modules of a cut graph: each takes the dict of values crossing into it and
returns the dict of values later stages read, calling the user's own submodules."""

from __future__ import annotations

import operator
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list

from gpipe.dataflow import INPUT, Dataflow
from gpipe.randomness import LayerKey
from gpipe.split.cuts import Cuts
from gpipe.split.trace import Traced

__all__ = ["SplitStage", "build_stages"]

LayerScope = Callable[[LayerKey], AbstractContextManager[Any]]


class SplitStage(nn.Module):
    """One stage of a traced model: its part of the graph, over the user's own submodules.

    Its children are the user's submodules (and parameters, buffers) that its part of the
    graph uses, under their names in the user's model, so ``state_dict`` keys read as there
    and gradients land on the user's Parameters. A Parameter two stages read (an embedding
    tied to the head) is the same object in both.

    Where torch.fx traced into a module to read its tensors (``self.weight`` in GPT-2's
    ``Conv1D``, a custom RMSNorm), the stage holds that module itself if all it holds is
    read here (or nowhere), so an ``init_fn`` sees the user's class. Otherwise (a model
    whose own forward reads its ``pos_embed``) a bare module stands in on the path and
    holds just the tensors read here; whenever they are replaced (``to_empty``, ``.to``,
    freeing), :meth:`write_through` puts the new ones back into the user's module, so the
    tensor a stage trains is always the one the user's model holds.

    Like :class:`gpipe.partition.Partition`, ``positions`` lists the random streams of the
    code that runs here (see ``Cuts.stream_of``: each run of a submodule's code has its
    own), and the runtime may set ``layer_scope``: then each run's nodes run inside
    ``layer_scope(stream)``, so each call draws from its own random stream wherever the
    cuts put it, and one dropout module called at two places draws two masks.
    """

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        positions: dict[str, LayerKey],
        name: str,
    ):
        super().__init__()
        code = fx.GraphModule(root, graph, class_name=name)
        # NOTE: the GraphModule copied references (not copies) of what its graph reads; this
        # module takes them over so it, not a hidden GraphModule, is what .to() and
        # state_dict() see, and runs the GraphModule's generated code with itself as `self`.
        for key, child in code._modules.items():
            self._modules[key] = child
        for key, param in code._parameters.items():
            self._parameters[key] = param
        for key, buffer in code._buffers.items():
            self._buffers[key] = buffer
        self.graph = code.graph
        self._code = type(code).forward
        self._position_of = positions  # node name -> its random stream
        self.positions = sorted(set(positions.values()), key=list(positions.values()).index)
        self.layer_scope: LayerScope | None = None
        # (stand-in, the user's module it stands for): bare modules torch.fx made on the
        # path to tensors it read, whose tensors write_through puts back into the user's
        self._stand_ins: list[tuple[nn.Module, nn.Module]] = []

    def adopt(self, root: nn.Module, spare: set[int]) -> None:
        """Hold the user's own modules where torch.fx made stand-ins for them.

        Args:
            root: the user's model.
            spare: the tensors (by id) that no stage reads; a module holding some of them
                besides tensors read here is adopted all the same.
        """
        if self._parameters or self._buffers:  # what the model's own forward reads
            self._stand_ins.append((self, root))
        self._adopt(self, root, _tensor_ids(self) | spare)

    def _adopt(self, mine: nn.Module, theirs: nn.Module, readable: set[int]) -> None:
        """Put the user's module in place of each stand-in torch.fx made for it below
        ``mine``, where every tensor it holds is in ``readable``; keep the others as
        stand-ins."""
        for key, child in list(mine._modules.items()):
            user = theirs._modules.get(key)
            if user is None or child is user or child is None:
                continue
            if _tensor_ids(user) <= readable:
                mine._modules[key] = user
                continue
            if child._parameters or child._buffers:
                self._stand_ins.append((child, user))
            self._adopt(child, user, readable)

    def stand_ins(self) -> list[tuple[nn.Module, nn.Module]]:
        """Each bare module torch.fx made here, with the user's module it stands for."""
        return list(self._stand_ins)

    def write_through(self) -> None:
        """Put each tensor a stand-in holds into the user's module it stands for.

        Called after anything that replaces a stage's tensors (materializing from meta,
        moving buffers, freeing another rank's stages), so the user's model holds what
        the stage trains (``model.<name>.weight.grad`` is set) and frees what it frees.
        """
        for stand_in, user in self._stand_ins:
            for key, param in stand_in._parameters.items():
                if key in user._parameters:
                    user._parameters[key] = param
            for key, buffer in stand_in._buffers.items():
                if key in user._buffers:
                    user._buffers[key] = buffer

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> SplitStage:
        super()._apply(fn, recurse)
        self.write_through()
        return self

    def forward(self, values: dict[str, Any]) -> Any:
        if self.layer_scope is None:
            return self._code(self, values)
        return _mutable(_Scoped(self, self.layer_scope).run(values))


def _tensor_ids(module: nn.Module) -> set[int]:
    return {id(t) for t in [*module.parameters(), *module.buffers()]}


def _mutable(value: Any) -> Any:
    """``value`` with fx's immutable dicts and lists as the plain ones the model returned.

    NOTE: an interpreted graph returns its output node's own containers (fx's
    ``immutable_dict``), the generated code a plain ``dict``; a pipe whose micro-batches ran
    either way (recomputed or not) would find two output structures.
    """
    if isinstance(value, immutable_dict):
        return {key: _mutable(item) for key, item in value.items()}
    if isinstance(value, immutable_list):
        return [_mutable(item) for item in value]
    if type(value) is tuple:
        return tuple(_mutable(item) for item in value)
    return value


class _Scoped(fx.Interpreter):
    """Runs a stage node by node, each unit's run of nodes inside its ``layer_scope``."""

    def __init__(self, stage: SplitStage, scope: LayerScope) -> None:
        super().__init__(stage, graph=stage.graph)
        self._stage = stage
        self._scope = scope
        self._entered: LayerKey | None = None
        self._exits = ExitStack()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._exits:
            return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        position = self._stage._position_of.get(n.name)
        if position is not None and position != self._entered:
            self._exits.close()
            self._exits.enter_context(self._scope(position))
            self._entered = position
        return super().run_node(n)


def _source(node: fx.Node, cuts: Cuts) -> int:
    return INPUT if node.op == "placeholder" else cuts.stage_of[node]


def _name(node: fx.Node, traced: Traced) -> str:
    if node.op == "placeholder":
        return next(name for name, p in traced.placeholders.items() if p is node)
    return node.name


def build_stages(root: nn.Module, traced: Traced, cuts: Cuts) -> tuple[list[SplitStage], Dataflow]:
    """One :class:`SplitStage` per stage of ``cuts``, and the :class:`Dataflow` between them.

    A value crossing several cuts is read by each stage straight from the stage that makes
    it; parameter reads (``get_attr``) are repeated in every stage that needs them.
    """
    graph = traced.graph
    count = cuts.stages
    last = count - 1
    output = next(n for n in graph.nodes if n.op == "output")

    def source(node: fx.Node) -> int | None:
        if node.op == "placeholder":
            return INPUT
        if node.op == "get_attr":
            return None
        return cuts.stage_of[node]

    takes: list[list[fx.Node]] = [[] for _ in range(count)]
    for node in graph.nodes:
        reader = last if node is output else cuts.stage_of.get(node)
        if reader is None:
            continue
        for arg in node.all_input_nodes:
            origin = source(arg)
            if origin is not None and origin != reader and arg not in takes[reader]:
                takes[reader].append(arg)
    readers: dict[fx.Node, list[int]] = {}
    for reader, taken in enumerate(takes):
        for arg in taken:
            readers.setdefault(arg, []).append(reader)

    # NOTE: a tensor no stage reads (a rotary embedding's original_inv_freq beside the
    # inv_freq it reads) does not keep its module from being adopted; the first stage
    # whose module holds it takes it, so init_fn still sees that module whole.
    modules: list[SplitStage] = []
    for stage in range(count):
        mine = [n for n in graph.nodes if cuts.stage_of.get(n) == stage]
        gives = [n for n in mine if any(r > stage for r in readers.get(n, ()))]
        body, copies = _stage_graph(
            traced, takes[stage], mine, gives, output if stage == last else None
        )
        positions = {copies[n].name: cuts.stream_of[n] for n in mine}
        modules.append(SplitStage(root, body, positions, f"Stage{stage}"))
    spare = _tensor_ids(root).difference(*map(_tensor_ids, modules))
    for module in modules:
        module.adopt(root, spare)
        spare -= _tensor_ids(module)
    dataflow = Dataflow(
        traced.inputs,
        tuple(tuple((_name(arg, traced), _source(arg, cuts)) for arg in taken) for taken in takes),
    )
    return modules, dataflow


def _stage_graph(
    traced: Traced,
    taken: list[fx.Node],
    mine: list[fx.Node],
    gives: list[fx.Node],
    output: fx.Node | None,
) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """The graph of one stage: read ``taken`` from the dict, run ``mine``, return the rest;
    and the copy of each node of ``mine`` in it."""
    body = fx.Graph()
    values = body.placeholder("values")
    env: dict[fx.Node, fx.Node] = {}
    for arg in taken:
        env[arg] = body.call_function(operator.getitem, (values, _name(arg, traced)))

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":
            env[node] = body.node_copy(node)
        return env[node]

    for node in mine:
        env[node] = body.node_copy(node, lookup)
    if output is None:
        body.output({node.name: env[node] for node in gives})
    else:
        body.output(fx.map_arg(output.args[0], lookup))
    body.lint()
    return body, env
