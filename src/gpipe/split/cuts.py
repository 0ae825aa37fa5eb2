"""Where the stages begin: units of the model, the submodule each graph node belongs to, and
the cuts that split points or a balance put before them.

A *unit* is what a balance counts: each top-level child of the model, except that a
container child (``nn.ModuleList``, ``nn.Sequential``) counts each of its children
(``h.0``, ``h.1``, ...), and a child holding a container at any depth counts its own units
so (GPT-2's ``transformer.wte``, ..., ``transformer.h.0``, ...; BERT's
``bert.embeddings``, ``bert.encoder.layer.0``, ...). A split
point inside a unit splits that unit into its children, so a cut always falls at a unit's
start.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx, nn

from gpipe.randomness import LayerKey

__all__ = ["Cuts", "cut_at_points", "cut_by_balance", "ordered_units", "units_of"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def owner(node: fx.Node) -> str | None:
    """The qualified name of the innermost submodule ``node`` belongs to; None: the model's
    own forward."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        path = str(node.target).rpartition(".")[0]
        return path or None
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0]) or None
    return None


def _within(path: str | None, prefix: str) -> bool:
    return path is not None and (path == prefix or path.startswith(prefix + "."))


def _compute(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that run: every node but inputs, parameter reads and the output."""
    return [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def units_of(model: nn.Module, split_points: Sequence[str] = ()) -> list[str]:
    """The candidate units, in registration order, refined so each split point is a unit."""
    units = _units_under(model, "")
    for point in split_points:
        while point not in units:
            inside = [u for u in units if point.startswith(u + ".")]
            if not inside:
                break  # a point enclosing several units (or none): cut at its first node
            at = units.index(inside[0])
            children = [
                f"{inside[0]}.{c}" for c, _ in model.get_submodule(inside[0]).named_children()
            ]
            units[at : at + 1] = children or [inside[0]]
            if not children:
                break
    return units


def _units_under(module: nn.Module, prefix: str) -> list[str]:
    """The units below ``module``: each child, a container's children, and the units of a
    child that holds a container at any depth (GPT-2's ``transformer`` holding ``h``:
    ``transformer.wte``, ..., ``transformer.h.0``, ...; BERT's ``bert.encoder.layer.0``),
    as Hugging Face models nest their blocks."""
    units: list[str] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, _CONTAINERS) and len(child) > 0:
            units += [f"{path}.{sub}" for sub, _ in child.named_children()]
        elif any(isinstance(c, _CONTAINERS) and len(c) > 0 for c in child.modules()):
            units += _units_under(child, path + ".")
        else:
            units.append(path)
    return units


def ordered_units(model: nn.Module, graph: fx.Graph) -> list[str]:
    """The units of ``model``, in the order its forward first runs them."""
    return _positions(_compute(graph), units_of(model))[1]


@dataclass(frozen=True)
class Cuts:
    """The stage of every node that runs, and the unit (position) of each.

    Attributes:
        stage_of: the stage of each compute node.
        position_of: the unit index of each compute node.
        units: the units in the order the model first runs them.
        balance: units per stage (the units whose first node falls in that stage).
        stream_of: the random stream of each compute node: the name of the innermost
            submodule running it, and for a module the model runs again later (T5's
            ``encoder.dropout``, called after the embedding and after the last block),
            ``"<name>#<run>"`` for each run after the first, so each call draws its own
            mask, as in plain PyTorch.
    """

    stage_of: dict[fx.Node, int]
    position_of: dict[fx.Node, int]
    units: list[str]
    balance: list[int]
    stream_of: dict[fx.Node, LayerKey] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        return len(self.balance)


def _positions(nodes: list[fx.Node], units: Sequence[str]) -> tuple[dict[fx.Node, int], list[str]]:
    """Each node's unit, as an index into the units ordered by first use.

    A node of no unit (an addition in the model's own forward) belongs to the unit before it,
    or to the first unit if none ran yet.
    """
    ordered: list[str] = []
    unit_of: dict[fx.Node, str | None] = {}
    for node in nodes:
        path = owner(node)
        unit = max((u for u in units if _within(path, u)), key=len, default=None)
        unit_of[node] = unit
        if unit is not None and unit not in ordered:
            ordered.append(unit)
    if not ordered:
        ordered = ["<forward>"]
    index = {u: i for i, u in enumerate(ordered)}
    positions: dict[fx.Node, int] = {}
    current = 0
    for node in nodes:
        unit = unit_of[node]
        if unit is not None:
            current = index[unit]
        positions[node] = current
    return positions, ordered


def _first_nodes(nodes: list[fx.Node], ordered: list[str]) -> dict[str, int]:
    first: dict[str, int] = {}
    for at, node in enumerate(nodes):
        path = owner(node)
        for unit in ordered:
            if unit not in first and _within(path, unit):
                first[unit] = at
    return first


def _assign(
    nodes: list[fx.Node], starts: list[int], positions: dict[fx.Node, int], ordered: list[str]
) -> Cuts:
    stage_of: dict[fx.Node, int] = {}
    stage = 0
    for at, node in enumerate(nodes):
        while stage < len(starts) and at >= starts[stage]:
            stage += 1
        stage_of[node] = stage
    first = _first_nodes(nodes, ordered)
    balance = [0] * (len(starts) + 1)
    for unit in ordered:
        at = first.get(unit, 0)
        balance[sum(1 for s in starts if at >= s)] += 1
    return Cuts(stage_of, positions, ordered, balance, _streams(nodes))


def _streams(nodes: list[fx.Node]) -> dict[fx.Node, LayerKey]:
    """Each node's random stream: the name of the innermost submodule it belongs to ("" for
    the model's own forward), numbered by that module's run.

    NOTE: named by module, not by unit, and counted over the whole graph, never per stage,
    so a call keeps its stream whatever the cuts and split points (a split point inside a
    unit would renumber the units), and two stages never draw under one key.
    """
    runs: dict[str, int] = {}
    streams: dict[fx.Node, LayerKey] = {}
    previous: str | None = None
    for node in nodes:
        name = owner(node) or ""
        if name != previous:
            runs[name] = runs.get(name, -1) + 1
            previous = name
        streams[node] = name if runs[name] == 0 else f"{name}#{runs[name]}"
    return streams


def cut_at_points(
    model: nn.Module, graph: fx.Graph, split_points: Sequence[str], leaves: frozenset[str]
) -> Cuts:
    """Cut before each split point's first node.

    Raises:
        TypeError: a split point is not a str.
        ValueError: a point names no submodule, lies inside a leaf, never runs, or the
            points are out of the model's order, repeated, or leave a stage empty.
    """
    known = dict(model.named_modules())
    for point in split_points:
        if not isinstance(point, str):
            raise TypeError(f"split points are submodule names (str), got {point!r}")
        if point not in known or point == "":
            close = difflib.get_close_matches(point, [n for n in known if n], n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"split point {point!r} names no submodule of {type(model).__name__}: a split "
                f"point is a name from model.named_modules(), the cut goes before it{hint}"
            )
        enclosing = [leaf for leaf in leaves if point.startswith(leaf + ".")]
        if enclosing:
            raise ValueError(
                f"split point {point!r} is inside the leaf module {enclosing[0]!r}, which is "
                f"called as a whole: cut before {enclosing[0]!r} instead, or take it out of "
                "leaf_modules (torch.nn's own layers are always leaves)"
            )
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split points repeat: {list(split_points)}")
    nodes = _compute(graph)
    starts: list[int] = []
    for point in split_points:
        at = next((i for i, n in enumerate(nodes) if _within(owner(n), point)), None)
        if at is None:
            raise ValueError(
                f"split point {point!r} never runs in {type(model).__name__}.forward (or only "
                "reads parameters there), so there is nothing to cut before"
            )
        starts.append(at)
    order = sorted(range(len(split_points)), key=lambda i: starts[i])
    if order != list(range(len(split_points))):
        raise ValueError(
            f"split points {list(split_points)} are out of order: the model runs them as "
            f"{[split_points[i] for i in order]}; list them in that order"
        )
    for i, at in enumerate(starts):
        previous = starts[i - 1] if i else 0
        if at == previous:
            what = f"between {split_points[i - 1]!r} and" if i else "before"
            raise ValueError(
                f"stage {i} would be empty: nothing runs {what} split point "
                f"{split_points[i]!r}; drop that point"
            )
    bounds = [0, *starts, len(nodes)]
    for i in range(len(starts) + 1):
        part = nodes[bounds[i] : bounds[i + 1]]
        if all(owner(n) is None for n in part):
            point = split_points[i] if i < len(split_points) else split_points[-1]
            raise ValueError(
                f"stage {i} would call no submodule, only {[n.name for n in part][:5]} of the "
                f"model's own forward: drop split point {point!r}"
            )
    positions, ordered = _positions(nodes, units_of(model, split_points))
    return _assign(nodes, starts, positions, ordered)


def cut_by_balance(model: nn.Module, graph: fx.Graph, balance: Sequence[int]) -> Cuts:
    """Cut so stage ``s`` holds ``balance[s]`` units (in the order the model runs them).

    Raises:
        TypeError: ``balance`` is not a list of ints.
        ValueError: an entry below 1, or the entries do not add up to the unit count.
    """
    if isinstance(balance, (str, bytes)) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in balance
    ):
        raise TypeError(
            f"balance must be a list of ints (units per stage), 'time' or 'memory'; got {balance!r}"
        )
    nodes = _compute(graph)
    positions, ordered = _positions(nodes, units_of(model))
    if any(b < 1 for b in balance) or sum(balance) != len(ordered):
        raise ValueError(
            f"balance={list(balance)} must give each stage at least one unit and add up to "
            f"the model's {len(ordered)} units, in the order it runs them: {ordered}; or let "
            "gpipe.split measure one: balance='time', num_stages=K"
        )
    first = _first_nodes(nodes, ordered)
    starts = []
    total = 0
    for size in balance[:-1]:
        total += size
        starts.append(first[ordered[total]])
    return _assign(nodes, starts, positions, ordered)
