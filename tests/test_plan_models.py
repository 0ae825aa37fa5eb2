"""Planning a model that is not a chain: gpipe.split's Stages, any module with a sample (cut at
every unit or among given split points), and a (model, sample) pair from ``gpipe plan``;
each plan's pipe trains exactly like plain PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpipe
from gpipe import GPipe
from gpipe.cli import main
from gpipe.grouping import group_stages
from gpipe.models import GPT2Config, gpt2, gpt_loss
from gpipe.planning.plan_report import Plan, PlanReport
from gpipe.planning.planner import plan

# The GPT-2-layout model's units, in the order it runs them: a residual stream through the
# blocks, and lm_head's weight is wte's (tied).
UNITS = [
    "transformer.wte",
    "transformer.wpe",
    "transformer.drop",
    *(f"transformer.h.{i}" for i in range(4)),
    "transformer.ln_f",
    "lm_head",
]
FAST = {
    "chunks": [2, 4],
    "schedules": ("1f1b",),
    "checkpoints": ("never",),
    "action_overhead": 0.0,
    "repeats": 1,
    "progress": False,
}


def _gpt(dropout: float = 0.0) -> nn.Module:
    return gpt2(GPT2Config(n_layer=4, dropout=dropout), seed=0).double()


def _tokens(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 64, (batch, 17), generator=generator)
    return seq[:, :-1], seq[:, 1:]


def _plan(module: nn.Module, sample: Any, devices: int = 3, **kwargs: Any) -> PlanReport:
    return plan(module, sample, 8, ["cpu"] * devices, **{**FAST, **kwargs})


def _with_stages(report: PlanReport, stages: int) -> Plan:
    """The fastest plan of ``stages`` stages, ranked or not."""
    every = [*report.plans, *(r.plan for r in report.rejected)]
    return next(p for p in every if p.stages == stages)


def _trains_like_plain(model: nn.Module, pipe: GPipe) -> None:
    """One step of the pipe gives plain PyTorch's loss and every gradient."""
    idx, targets = _tokens()
    loss = gpt_loss(model(idx), targets)
    loss.backward()
    grads = {name: torch.clone(p.grad) for name, p in model.named_parameters()}  # type: ignore[arg-type]
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(pipe.train_step(idx, targets, gpt_loss), loss.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], msg=name)


def test_plan_groups_the_stages_of_a_split_gpt_and_its_pipe_trains_like_plain() -> None:
    model = _gpt()
    idx, _ = _tokens()
    stages = gpipe.split(model, balance=[2, 1, 1, 1, 1, 1, 2], example_inputs=(idx,))
    report = _plan(stages, idx)
    for p in [*report.plans, *(r.plan for r in report.rejected)]:
        assert p.pieces is not None and sum(p.pieces) == 7 and len(p.pieces) == p.stages
        assert sum(p.balance) == 9  # the model's units, not the pieces
        assert p.split_points is None
    chosen = _with_stages(report, 3)
    assert "stages of the Stages per stage" in str(report)
    pipe = GPipe.from_plan(stages, chosen)
    assert pipe.balance == list(chosen.balance) and len(pipe.partitions) == 3
    _trains_like_plain(model, pipe)


def test_plan_splits_any_module_at_its_units_and_names_the_split_points() -> None:
    model = _gpt()
    idx, targets = _tokens()
    report = _plan(model, idx, loss_fn=gpt_loss, target=targets)
    chosen = _with_stages(report, 3)
    assert chosen.split_points is not None and len(chosen.split_points) == 2
    assert set(chosen.split_points) <= set(UNITS[1:])
    assert sum(chosen.balance) == len(UNITS)
    starts = [UNITS.index(point) for point in chosen.split_points]
    assert chosen.balance == [starts[0], starts[1] - starts[0], len(UNITS) - starts[1]]
    assert report.best.split_points == () or report.best.stages > 1
    assert "split points: " in str(report)
    _trains_like_plain(model, GPipe.from_plan(model, chosen))


def test_plan_chooses_among_the_split_points_given() -> None:
    model = _gpt()
    idx, _ = _tokens()
    points = ["transformer.h.1", "transformer.h.3"]
    report = _plan(model, {"idx": idx}, split_points=points)
    every = [*report.plans, *(r.plan for r in report.rejected)]
    assert {p.stages for p in every} == {1, 2, 3}
    assert all(p.split_points is not None and set(p.split_points) <= set(points) for p in every)
    three = _with_stages(report, 3)
    assert three.split_points == tuple(points)
    assert three.balance == [4, 2, 3]  # wte, wpe, drop, h.0 | h.1, h.2 | h.3, ln_f, lm_head
    assert "balance" not in three.pipe_kwargs()
    _trains_like_plain(model, GPipe.from_plan(model, three))


def test_a_sequential_plan_keeps_its_pipe_arguments() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))).double()
    best = _plan(model, torch.randn(8, 4, dtype=torch.float64), devices=2).best
    assert best.split_points is None and best.pieces is None
    assert best.pipe_kwargs()["balance"] == best.balance
    assert best.cuts() == ""


def test_grouped_stages_draw_the_dropout_of_the_coarser_split() -> None:
    idx, targets = _tokens()
    results = []
    for grouped in (True, False):
        model = _gpt(dropout=0.2)
        if grouped:
            fine = gpipe.split(model, balance=[1] * len(UNITS), example_inputs=(idx,))
            stages = group_stages(fine, [4, 2, 3])
        else:
            points = ["transformer.h.1", "transformer.h.3"]
            stages = gpipe.split(model, split_points=points, example_inputs=(idx,))
        pipe = GPipe(stages, devices=["cpu"] * 3, chunks=2, checkpoint="except_last")
        torch.manual_seed(7)
        loss = pipe.train_step(idx, targets, gpt_loss)
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
        assert pipe.balance == [4, 2, 3]
    (loss, grads), (coarse_loss, coarse_grads) = results
    torch.testing.assert_close(loss, coarse_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, coarse_grads[name], msg=name)


def test_grouped_stages_run_like_the_model_and_route_values_between_groups() -> None:
    model = _gpt()
    idx, _ = _tokens()
    fine = gpipe.split(model, balance=[1] * len(UNITS), example_inputs=(idx,))
    grouped = group_stages(fine, [3, 4, 2])
    assert grouped.balance == [3, 4, 2] and grouped.devices is None
    # the residual stream crosses each cut; the causal mask, made in stage 0, reaches the
    # blocks of group 1 straight from group 0
    assert [source for _, source in grouped.dataflow.takes[1]] == [0, 0]
    torch.testing.assert_close(grouped(idx), model(idx))
    with pytest.raises(ValueError, match=r"add up to the 9 stages"):
        group_stages(fine, [3, 3])
    with pytest.raises(TypeError, match="counts must be a list of ints"):
        group_stages(fine, "3,6")  # type: ignore[arg-type]


def test_grouped_skip_stages_keep_apart_the_chain_values_every_stage_gives() -> None:
    from gpipe.skip import pop, skippable, stash
    from gpipe.skip import stages as skip_stages

    @skippable(stash=["early"])
    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("early", x)
            return x * 2

    @skippable(pop=["early"])
    class Add(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            early = yield pop("early")
            return x + early

    torch.manual_seed(0)
    model = nn.Sequential(Keep(), nn.Linear(4, 4), nn.Tanh(), Add(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    fine = skip_stages(model, [1, 1, 1, 1, 1])
    for counts in ([2, 3], [1, 2, 2], [3, 1, 1]):
        grouped = group_stages(fine, counts)
        torch.testing.assert_close(grouped(x), model(x))
        pipe = GPipe(grouped, devices=["cpu"] * len(counts), chunks=3)
        torch.testing.assert_close(pipe(x), model(x))


def test_refusals_name_the_fix() -> None:
    idx, _ = _tokens()
    with pytest.raises(TypeError, match=r"nn.Sequential\(\*layers\).*gpipe.split"):
        _plan(nn.Linear(4, 4), torch.randn(8, 4))
    with pytest.raises(TypeError, match=r"plan needs the model, an nn.Module"):
        _plan(lambda x: x, idx)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="leave split_points out"):
        _plan(nn.Sequential(nn.Linear(4, 4)), torch.randn(8, 4), split_points=["0"])
    with pytest.raises(ValueError, match="names no submodule"):
        _plan(_gpt(), idx, split_points=["transformer.h.9"])
    with pytest.raises(TypeError, match=r"gpipe.split"):
        GPipe(_gpt())  # type: ignore[arg-type]
    model = _gpt()
    report = _plan(model, idx, devices=2)
    with pytest.raises(TypeError, match=r"splits a model with gpipe.split"):
        GPipe.from_plan(nn.Sequential(nn.Linear(4, 4)), report)
    stages = gpipe.split(model, balance=[5, 4], example_inputs=(idx,))
    with pytest.raises(TypeError, match=r"groups the pieces of a gpipe.Stages"):
        GPipe.from_plan(model, _plan(stages, idx, devices=2))
    sequential = _plan(nn.Sequential(nn.Linear(4, 4)), torch.randn(8, 4), devices=1)
    with pytest.raises(TypeError, match=r"cuts an nn.Sequential's layers.*gpipe.split"):
        GPipe.from_plan(model, sequential)


def _result_fields(output: str) -> dict[str, str]:
    last = output.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(field.split("=", 1) for field in last.split()[1:])


ARGS = ["--batch-size", "4", "--chunks", "2", "--schedules", "1f1b", "--checkpoints", "never"]


def test_cli_plans_a_model_and_sample_pair_among_split_points(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pair_models.py").write_text(
        "import torch\n"
        "from gpipe.models import GPT2Config, gpt2\n\n\n"
        "def gpt_pair():\n"
        "    idx = torch.randint(0, 64, (2, 8))\n"
        "    mask = torch.ones(2, 8)\n"
        "    return gpt2(GPT2Config(n_layer=2)), {'idx': idx, 'attention_mask': mask}\n\n\n"
        "def residual():\n"
        "    class Residual(torch.nn.Module):\n"
        "        def __init__(self):\n"
        "            super().__init__()\n"
        "            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)\n\n"
        "        def forward(self, x):\n"
        "            return x + self.b(self.a(x))\n\n"
        "    return Residual()\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "pair_models:gpt_pair", "--stages", "2", "--no-progress"]
    points = ["--split-points", "transformer.h.1"]
    assert main([*argv, *ARGS, *points]) == 0
    out = capsys.readouterr().out
    assert _result_fields(out)["split_points"] in ("none", "transformer.h.1")
    assert "split points: " in out

    argv = ["plan", "--model", "pair_models:residual", "--sample-shape", "6", "--stages", "2"]
    assert main([*argv, *ARGS, "--no-progress"]) == 0
    fields = _result_fields(capsys.readouterr().out)
    assert fields["split_points"] in ("none", "b")


def test_cli_refuses_what_is_not_a_model_and_split_points_for_a_sequential(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "odd_models.py").write_text(
        "import torch\n\n\n"
        "def not_a_model():\n"
        "    return 'gpt', torch.zeros(2, 3)\n\n\n"
        "def chain():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "odd_models:not_a_model", "--no-progress"]) == 2
    assert "must return a model (an nn.Sequential, gpipe.Stages" in capsys.readouterr().err
    argv = ["plan", "--model", "odd_models:chain", "--sample-shape", "3", "--stages", "2"]
    assert main([*argv, *ARGS, "--split-points", "1", "--no-progress"]) == 2
    assert "leave split_points out" in capsys.readouterr().err
