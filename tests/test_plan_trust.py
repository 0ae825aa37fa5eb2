"""A plan you can trust: the same answer on a busy host, ties said as ties, and predictions
checked against real steps (issue 38)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpipe.balance import layer_timing, profile
from gpipe.cli import main
from gpipe.planning.plan_report import Plan
from gpipe.planning.planner import plan
from gpipe.planning.ranking import PREFERENCE, rank
from gpipe.planning.verify import SCALE_BOUNDS, Calibration, fit


def mlp(width: int = 32, blocks: int = 6) -> nn.Sequential:
    """The issue's model, smaller: equal Linear + ReLU blocks and a small head."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def test_identical_layers_share_one_cost() -> None:
    torch.manual_seed(0)
    measured = profile(mlp(), torch.randn(8, 32), repeats=3, warmup=1)
    linears = [measured.forward[i] + measured.backward[i] for i in range(0, 12, 2)]
    relus = [measured.forward[i] + measured.backward[i] for i in range(1, 12, 2)]
    # exactly equal, whatever the host's noise did to each: a balance cannot follow it
    assert len(set(linears)) == 1 and len(set(relus)) == 1
    assert len({measured.spread[i] for i in range(0, 12, 2)}) == 1
    # the head differs (other shapes), and stays its own
    assert measured.forward[12] + measured.backward[12] != linears[0]
    assert all(s >= 0 for s in measured.spread)


# Each layer's true cost per row in this fake host: forward, and twice that backward.
TRUE_SECONDS_PER_ROW = {"Linear": 20e-6, "ReLU": 2e-6}


@pytest.fixture
def bursty_host(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """A host where other work comes in long bursts: every layer run pays its true cost,
    times 3-30 while a burst lasts (the seed draws how much, run by run). A burst covers
    the middle three of the five timed rounds (three of each layer's five runs: more than
    a median can ignore; a clean round left in each half, so no drift either): call the
    returned function with a seed before each profile."""
    state: dict[str, Any] = {}

    def fake_run(layer: nn.Module, value: Any, device: Any, split: bool) -> tuple[float, ...]:
        base = TRUE_SECONDS_PER_ROW[type(layer).__name__] * value.shape[0]
        start, length = state["burst"]
        state["calls"] += 1
        slow = state["rng"].uniform(3, 30) if start <= state["calls"] < start + length else 1.0
        forward, backward = base * slow, 2 * base * slow
        return forward, backward, forward + backward, backward / 2 if split else 0.0

    def reseed(seed: int) -> None:
        state["rng"] = random.Random(seed)
        state["calls"] = 0
        # sizes 8, 4, 2, 1 (chunks 1, 2, 4, 8 of 8 rows), 13 layers: 52 runs per round and
        # way of timing (see layer_timing), 2 warm-up rounds and 5 timed ones
        runs = 52 * len(layer_timing._thread_ways(torch.device("cpu")))
        state["burst"] = (3 * runs + 1, 3 * runs)

    monkeypatch.setattr(layer_timing, "run_once", fake_run)
    reseed(0)
    return reseed


def test_bursts_of_other_work_do_not_move_the_plan(
    bursty_host: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five runs, each with a burst of other work somewhere in the profile: one plan."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # no core sharing in this fake host
    picks, steps = [], []
    for seed in range(5):
        bursty_host(seed)
        report = plan(
            mlp(),
            torch.randn(8, 32),
            8,
            ["cpu"] * 2,
            schedules=("1f1b",),
            checkpoints=("never",),
            repeats=5,
            action_overhead=1e-4,
            progress=False,
        )
        picks.append(report.best.describe())
        steps.append(report.best.predicted_step)
    assert len(set(picks)) == 1, picks
    # the fastest runs are the true costs in every seed: the same prediction to the bit
    assert len(set(steps)) == 1, steps


def _plan(chunks: int, low: float, high: float, **changes: Any) -> Plan:
    base = Plan(
        stages=2,
        chunks=chunks,
        checkpoint="never",
        schedule="1f1b",
        virtual_stages=1,
        balance=[1, 1],
        devices=["cpu", "cpu"],
        predicted_step=low,
        bubble=0.1,
        peak_memory=[100, 100],
        activation_memory=[10, 10],
        predicted_high=high,
    )
    return dataclasses.replace(base, **changes)


def test_plans_within_noise_are_named_and_the_simpler_listed_first() -> None:
    fast = _plan(4, 0.0100, 0.0110)
    close = _plan(2, 0.0104, 0.0112)  # starts inside the fastest one's range
    far = _plan(8, 0.0120, 0.0125)
    report = rank([far, fast, close], None, 5, ("1f1b",), ("never",))
    assert [p.chunks for p in report] == [2, 4, 8]
    (note,) = report.notes
    assert "within noise" in note and fast.describe() in note and close.describe() in note
    assert far.describe() not in note
    assert note.endswith(f"{close.describe()} is listed first: {PREFERENCE[1]}")
    # apart beyond the noise, the faster prediction leads and nothing is said
    report = rank([_plan(2, 0.0120, 0.0121), fast], None, 5, ("1f1b",), ("never",))
    assert [p.chunks for p in report] == [4, 2] and report.notes == []


def test_verified_plans_rank_by_measured_time_and_say_when_it_reorders() -> None:
    predicted_fast = _plan(8, 0.010, 0.010, measured_step=0.030, measured_range=(0.029, 0.031))
    measured_fast = _plan(2, 0.012, 0.012, measured_step=0.020, measured_range=(0.019, 0.021))
    unverified = _plan(4, 0.005, 0.005)
    report = rank([predicted_fast, unverified, measured_fast], None, 5, ("1f1b",), ("never",))
    assert [p.chunks for p in report] == [2, 8, 4]  # what ran first, by what it measured
    assert any(n.startswith("re-ranked by measured time") for n in report.notes)
    report = rank([predicted_fast, measured_fast], None, 1, ("1f1b",), ("never",))
    assert report.rejected[0].reason == "slower: +50.0% (measured 30.00 ms)"


def test_fit_finds_the_scale_and_per_action_cost_that_explain_the_steps() -> None:
    compute, actions = [0.010, 0.012, 0.020], [4.0, 10.0, 34.0]
    measured = [1.5 * c + 0.0007 * a for c, a in zip(compute, actions)]
    scale, overhead = fit(measured, compute, actions, fallback_overhead=0.0001)
    assert scale == pytest.approx(1.5) and overhead == pytest.approx(0.0007)
    # one plan cannot separate the two: the given per-action cost stays, the scale fits
    scale, overhead = fit([0.02], [0.01], [10.0], fallback_overhead=0.0005)
    assert overhead == 0.0005 and 0.01 * scale + 10 * 0.0005 == pytest.approx(0.02)
    # steps that fall with more actions: no negative per-action cost
    scale, overhead = fit([0.02, 0.01], [0.01, 0.01], [2.0, 20.0], fallback_overhead=0.0)
    assert overhead == 0.0 and scale > 0
    # a profile 20x too slow is noise trading one term for the other: the scale is bounded
    scale, overhead = fit([0.010, 0.030], [0.2, 0.2], [1.0, 30.0], fallback_overhead=0.0)
    assert scale == SCALE_BOUNDS[0] and overhead >= 0


def test_verify_runs_the_top_plans_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 3)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    report = plan(
        model,
        x,
        8,
        ["cpu"] * 2,
        loss_fn=nn.functional.cross_entropy,
        target=y,
        schedules=("gpipe", "1f1b"),
        checkpoints=("never",),
        chunks=[1, 2, 4],
        repeats=2,
        progress=False,
        verify=True,
        verify_top=2,
        verify_steps=2,
    )
    verified = [p for p in report if p.measured_step is not None]
    assert len(verified) >= 2 and report.best.measured_step is not None
    assert report[: len(verified)] == verified  # what ran leads
    for p in verified:
        assert p.measured_range is not None
        assert p.measured_range[0] <= p.measured_step <= p.measured_range[1]
    assert report.calibration is not None and report.calibration.plans == len(verified)
    assert report.calibration.time_scale > 0 and report.calibration.action_overhead >= 0
    assert any(n.startswith("calibrated by the verified plans") for n in report.notes)
    assert "measured step" in str(report)
    after = model.state_dict()
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert all(p.grad is None for p in model.parameters())


def test_a_calibration_feeds_back_into_the_predictions() -> None:
    torch.manual_seed(0)
    model, x = mlp(width=8, blocks=2), torch.randn(4, 8)
    common: dict[str, Any] = dict(
        schedules=("1f1b",), checkpoints=("never",), chunks=[2], repeats=1, progress=False
    )

    def measured_once(module: nn.Sequential, samples: list[Any], **kwargs: Any) -> Any:
        return fixed

    from gpipe.planning import measurements

    fixed = measurements.profile_samples(model, [x[:2]])
    fixed = [dataclasses.replace(fixed[0], cpu=[0.0] * len(model))]  # no core sharing
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(measurements, "profile_samples", measured_once)
        plain = plan(model, x, 4, ["cpu"] * 2, action_overhead=0.0, **common).best
        tuned = plan(
            model, x, 4, ["cpu"] * 2, calibration=Calibration(0.0, 2.0, 1.5), **common
        ).best
    assert tuned.predicted_step == pytest.approx(2 * plain.predicted_step)
    assert tuned.headroom == 1.5
    assert tuned.needed_memory == [-(-b * 3 // 2) for b in tuned.peak_memory]


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"verify": "yes"}, TypeError, "verify must be True or False"),
        ({"verify_top": 0}, ValueError, "verify_top and verify_steps must be >= 1"),
        ({"calibration": (0.1, 1.0, 1.0)}, TypeError, "report.calibration"),
        (
            {"calibration": Calibration(0.0, 1.0), "action_overhead": 0.0},
            ValueError,
            "pass it alone",
        ),
    ],
)
def test_bad_verification_arguments_name_the_fix(
    changes: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        plan(mlp(8, 1), torch.randn(2, 8), 2, ["cpu"], progress=False, **changes)


def result_fields(out: str) -> dict[str, str]:
    line = [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
    return dict(field.split("=", 1) for field in line.split()[1:])


def test_cli_verify_prints_measured_beside_predicted_and_the_calibration(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "trust_models.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["plan", "--model", "trust_models:build", "--sample-shape", "12", "--stages", "2"]
    base += ["--batch-size", "4", "--chunks", "1,2", "--schedules", "1f1b", "--no-progress"]
    base += ["--checkpoints", "never", "--repeats", "1"]
    assert main([*base, "--verify", "--verify-top", "2", "--verify-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "measured step" in out and "feed it back on this host" in out
    fields = result_fields(out)
    assert float(fields["measured_ms"]) > 0 and fields["verified"] == "2"
    calibration = fields["calibration"]
    assert len(calibration.split(",")) == 3

    assert main([*base, "--calibration", calibration]) == 0
    assert "measured_ms" not in result_fields(capsys.readouterr().out)

    with pytest.raises(SystemExit) as exit_:
        main([*base, "--calibration", "fast"])
    assert exit_.value.code == 2
    assert "MS,SCALE,HEADROOM" in capsys.readouterr().err


_threads = [2]  # the intra-op threads of the fake torch below


def test_a_parallel_op_stalled_by_a_busy_core_is_timed_on_one_thread_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While other work holds a core, each parallel op waits for its threads: 30x slow,
    for as long as the work lasts. The one-thread timing waits for nobody, and is kept."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: _threads[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: _threads.__setitem__(0, n))
    _threads[0] = 2

    def stalled(layer: nn.Module, value: Any, device: Any, split: bool) -> tuple[float, ...]:
        base = TRUE_SECONDS_PER_ROW[type(layer).__name__] * value.shape[0]
        slow = 30.0 if torch.get_num_threads() > 1 else 1.0
        return base * slow, 2 * base * slow, 3 * base * slow, 0.0

    monkeypatch.setattr(layer_timing, "run_once", stalled)
    measured = profile(mlp(), torch.randn(8, 32), repeats=3, warmup=0)
    assert measured.forward[0] == pytest.approx(TRUE_SECONDS_PER_ROW["Linear"] * 8)
    assert _threads[0] == 2  # torch's count as it was


def test_a_drift_between_the_first_and_second_half_of_the_rounds_widens_the_spread() -> None:
    steady = layer_timing.Samples([1.0] * 6, [2.0] * 6, [], [3.0] * 6)
    drifting = layer_timing.Samples([1.0] * 3 + [1.3] * 3, [2.0] * 6, [], [3.0] * 6)
    assert layer_timing.summarize(steady).spread == 0.0
    # the second half's fastest lay 0.3 s above the first half's: 10 % of the 3 s total
    assert layer_timing.summarize(drifting).spread == pytest.approx(0.1)
