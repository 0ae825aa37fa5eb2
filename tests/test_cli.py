"""The gpipe command line: simulate, bubble, and the commands plugged in from other modules."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

import gpipe
import gpipe.schedule
from gpipe.analysis import bubble_formula
from gpipe.cli import build_parser, main
from gpipe.cli.plan_text import why_this_plan
from gpipe.planning.plan_report import Plan, PlanReport, Rejection


def result_fields(output: str) -> dict[str, str]:
    last = output.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    return dict(field.split("=", 1) for field in last.split()[1:])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def bad_args(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_simulate_gpipe_reports_the_fill_drain_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(
        capsys,
        "simulate",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--schedule",
        "gpipe",
        "--no-color",
    )
    assert code == 0
    fields = result_fields(out)
    assert fields["schedule"] == "gpipe"
    assert (fields["stages"], fields["microbatches"]) == ("4", "8")
    assert fields["bubble"] == f"{3 / 11:.4f}" == "0.2727"
    # F=1 and B+W=2 per micro-batch and stage: (M+K-1) * 3 = 33.
    assert fields["makespan"] == "33"
    # GPipe holds every micro-batch's activations before the first backward.
    assert fields["peak_memory"] == "8,8,8,8"
    assert float(fields["sim_seconds"]) >= 0


def test_simulate_prints_the_grid_and_an_uncolored_chart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(capsys, "simulate", "-K", "2", "-M", "3", "--no-color", "--width", "80")
    assert "0F0" in out and "1B2" in out  # the step x device grid
    assert "gpipe: 2 devices, 3 micro-batches, makespan 12 cost" in out
    assert "\x1b" not in out


def test_simulate_1f1b_holds_fewer_activations_down_the_pipeline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "1f1b", "--no-color")
    fields = result_fields(out)
    assert fields["peak_memory"] == "4,3,2,1"
    assert fields["bubble"] == "0.2727"


def test_simulate_costs_and_transfer_change_the_makespan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(
        capsys,
        "simulate",
        "-K",
        "2",
        "-M",
        "2",
        "--costs",
        "1,2,0",
        "--transfer",
        "0.5",
        "--no-color",
    )
    # F0 F1 on dev 0 (0..2), dev 1 F at 1.5..2.5 and 2.5..3.5, B1 3.5..5.5, B0 5.5..7.5;
    # dev 0 runs B1 at 6..8 and B0 at 8..10.
    assert result_fields(out)["makespan"] == "10"


def test_simulate_writes_plot_and_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png, trace = tmp_path / "sim.png", tmp_path / "sim.json"
    code, out = run(
        capsys,
        "simulate",
        "-K",
        "2",
        "-M",
        "4",
        "--no-color",
        "--plot",
        str(png),
        "--trace",
        str(trace),
    )
    assert code == 0
    assert png.stat().st_size > 10_000
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 4 * 2
    assert f"wrote {png}" in out and f"wrote {trace}" in out
    assert out.strip().splitlines()[-1].startswith("RESULT ")


def test_bubble_table_matches_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(
        capsys,
        "bubble",
        "--stages",
        "2",
        "4",
        "--microbatches",
        "2",
        "4",
        "8",
        "--schedule",
        "gpipe",
        "interleaved",
    )
    assert code == 0
    fields = result_fields(out)
    assert fields["cells"] == "12"
    # Interleaved K=4 M=2 has no closed form (4 does not divide 2): 11 of 12 compared.
    assert fields["compared"] == "11"
    assert float(fields["max_abs_error"]) < 1e-9
    assert "0.273 (0.273)" in out  # gpipe K=4 M=8: 3/11
    assert "(n/a)" in out


def test_bubble_marks_schedules_that_cannot_be_built(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = gpipe.schedule.make_schedule

    def only_even(name: str, stages: int, microbatches: int, **kw: int) -> gpipe.Schedule:
        if microbatches % 2:
            raise ValueError("odd")
        return real(name, stages, microbatches, **kw)

    monkeypatch.setattr(gpipe.schedule, "make_schedule", only_even)
    _, out = run(capsys, "bubble", "-K", "2", "-M", "1", "2", "-s", "gpipe")
    row = next(line for line in out.splitlines() if line.split()[:1] == ["2"])
    assert row.split() == ["2", "-", "0.333", "(0.333)"]
    assert result_fields(out)["cells"] == "1"


def test_bubble_formulas_follow_the_papers() -> None:
    assert bubble_formula("gpipe", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_formula("1f1b", 8, 1, 1) == pytest.approx(7 / 8)
    assert bubble_formula("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula("interleaved", 4, 6, 2) is None
    assert bubble_formula("zb-h1", 4, 8, 1) == pytest.approx(3 / 27)
    assert bubble_formula("zb-h1", 8, 4, 1) is None
    assert bubble_formula("unknown", 4, 8, 1) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "-K", "0", "-M", "4"], "expected a whole number >= 1, got 0"),
        (["simulate", "-K", "four", "-M", "4"], "expected a whole number >= 1, got 'four'"),
        (["simulate", "-M", "4"], "the following arguments are required: --stages"),
        (["simulate", "-K", "2", "-M", "4", "--costs", "1,2"], "as F,B,W"),
        (["simulate", "-K", "2", "-M", "4", "--transfer", "-1"], "number >= 0, got -1"),
        (["simulate", "-K", "2", "-M", "4", "-s", "nope"], "invalid choice: 'nope'"),
        (["simulate", "-K", "2", "-M", "4", "-s", "1f1b", "-v", "2"], "use schedule='interleaved'"),
        (["simulate", "-K", "4", "-M", "6", "-s", "dualpipev"], "pass -M 8 or more, or -s zb-v"),
        (["simulate", "-K", "2", "-M", "4", "-s", "1f1b", "--fused", "0.8"], "use it with -s dual"),
        (["simulate", "-K", "2", "-M", "4", "-s", "dualpipev", "--fused", "0"], "number > 0"),
        (["bubble", "-M", "0"], "expected a whole number >= 1"),
        (["simulate", "-K", "2", "-M", "4", "--memory-limit", "3"], "for -s auto only"),
        (["simulate", "-K", "2", "-M", "4", "-s", "auto", "--memory-limit", "0"], "> 0"),
        (["simulate", "-K", "2", "-M", "4", "-s", "auto", "--memory-limit", "0.5"], "no schedule"),
        (["bubble", "-s", "1f1b", "--memory-limit", "3"], "for -s auto only"),
        ([], "required: COMMAND"),
        (["simulate", "-K", "2", "-M", "4", "--costs", "inf,1,1"], "three finite numbers"),
        (["simulate", "-K", "2", "-M", "4", "--transfer", "inf"], "a finite number >= 0"),
        (["plan", "--devices", "cpu,,cpu"], "without empty entries, e.g. cpu,cpu; got 'cpu,,cpu'"),
        (["plan", "--sample-shape", "3,x"], "one sample's shape without the batch dimension"),
        (["plan", "--chunks", "2,a"], "comma-separated whole numbers >= 1"),
        (["plan", "--schedules", "gpipe,fast"], "unknown 'fast' in 'gpipe,fast'; choose from"),
        (["plan", "--checkpoints", "some"], "unknown 'some'"),
        (["plan", "--stages", "0"], "expected a whole number >= 1, got 0"),
        (["plan", "--memory-per-device", "lots"], "like 200MB"),
        (["plan", "--top", "0"], "expected a whole number >= 1, got 0"),
        (["demo", "--microbatches", "0"], "expected a whole number >= 1, got 0"),
        (["demo", "--seed", str(2**70)], "expected a whole number from -2**63 to 2**64 - 1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_fix(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = bad_args(capsys, *argv)
    assert message in err
    assert "Traceback" not in err


def test_a_command_is_a_module_with_add_arguments_and_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = types.ModuleType("gpipe.cli.plan", "Plan a pipeline.\n\nMore text.")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--layers", type=int, required=True)

    def run_plan(args: argparse.Namespace) -> int:
        print(f"planned {args.layers}")
        return 3

    plan.add_arguments = add_arguments  # type: ignore[attr-defined]
    plan.run = run_plan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gpipe.cli.plan", plan)
    assert "Plan a pipeline." in build_parser().format_help()
    assert run(capsys, "plan", "--layers", "5") == (3, "planned 5\n")


def test_simulate_zero_bubble_h1_reaches_its_formula(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "zb-h1", "--no-color")
    fields = result_fields(out)
    assert fields["bubble"] == f"{3 / 27:.4f}"
    assert fields["makespan"] == "27"  # 3M + K - 1 with F = B = W = 1


def test_simulate_zb_v_on_twice_the_stages_is_as_short_as_one_step_can_be(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "zb-v", "--no-color")
    fields = result_fields(out)
    assert fields["makespan"] == "51"  # 6M + K - 1 actions of half a stage
    assert fields["bubble"] == f"{3 / 51:.4f}"
    assert fields["peak_memory"] == "8,8,8,8"  # 2K half-stages: 1F1B's K


def test_simulate_dualpipev_shows_its_pairs_and_its_memory_beside_the_formula(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "dualpipev", "--no-color")
    fields = result_fields(out)
    assert "0F7+7B3+7W3" in out  # the step x device grid shows a fused pair
    assert fields["makespan"] == "54"  # pairs at their parts' sum: 6M + 2(K-1)
    assert fields["peak_memory"] == "9,9,9,9"
    assert fields["formula_memory"] == "9"  # 2K+1
    lines = out.splitlines()
    assert lines[-2].split()[:3] == ["memory", "9", "9"]
    assert lines[-2].split()[3:6] == ["2K+1,", "when", "M"]


def test_simulate_fused_pairs_that_overlap_shorten_dualpipev(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "-K", "4", "-M", "8", "-s", "dualpipev", "--no-color"]
    _, out = run(capsys, *argv, "--fused", "0.8")
    fields = result_fields(out)
    assert float(fields["makespan"]) < 54
    assert fields["peak_memory"] == "9,9,9,9"  # overlap changes the times, not the order


def test_simulate_puts_each_formula_beside_the_simulated_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "v-min", "--no-color")
    bubble, memory = out.splitlines()[-3:-1]
    assert bubble.split()[:3] == ["bubble", "0.1864", "0.1864"]  # 11 / 59
    assert memory.split()[:4] == ["memory", "4", "4", "min(2M,"]
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "zb-h1", "--costs", "1,2,1")
    bubble = out.splitlines()[-3]
    assert bubble.split()[2] == "n/a" and bubble.endswith("not with these costs")
    assert result_fields(out)["formula_bubble"] == "n/a"


def test_simulate_auto_searches_under_the_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "auto", "--memory-limit", "7")
    fields = result_fields(out)
    assert fields["makespan"] == "27"
    assert fields["steady_bubble"] == "0.0000"  # ZB-H2-like: no device idles mid-step
    assert max(float(p) for p in fields["peak_memory"].split(",")) <= 7
    _, out = run(capsys, "simulate", "-K", "4", "-M", "8", "-s", "auto", "--costs", "1,2,0.5")
    assert float(result_fields(out)["makespan"]) <= 3.5 * 8 + 3 * (1 + 2 - 0.5)  # ZB-H1's


def test_bubble_tabulates_auto_at_a_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = run(capsys, "bubble", "-K", "4", "-M", "8", "-s", "auto", "--memory-limit", "7")
    assert "auto, memory limit 7: simulated bubble" in out
    assert "0.111 (n/a)" in out  # 3 / 27: one step of ZB-H2


def test_bubble_defaults_cover_every_schedule_and_agree_with_formulas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(capsys, "bubble")
    assert code == 0
    fields = result_fields(out)
    assert fields["schedules"] == (
        "gpipe,1f1b,interleaved,zb-h1,zb-h2,zb-v,interleaved-zb,looped-bfs,v-half,v-min,dualpipev"
    )
    # dualpipev builds only where M >= 2K: 5 + 4 + 3 + 2 of its 28 cells
    assert fields["cells"] == str(10 * 4 * 7 + 14)
    assert float(fields["max_abs_error"]) < 1e-9
    # every cell has a memory formula, and the simulator's peak equals it in each
    assert fields["memory_compared"] == fields["cells"]
    assert fields["memory_max_abs_error"] == "0"
    assert "dualpipev, v=2: simulated bubble" in out
    assert "peak memory, formula 2K+1, when M >= 2K: the simulated peak equals it in all 14" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--schedules", "interleaved", "--stages", "1", "--no-progress"],
            "nothing to plan: interleaved on 1 device(s)",
        ),
        (
            ["plan", "--model", "gpipe.models:mlp", "--sample-shape", "7", "--no-progress"],
            "the model cannot run on a sample of shape (7,) (--sample-shape: one sample, "
            "without its batch dimension): RuntimeError: mat1 and mat2",
        ),
        (["plan", "--model", "no_such_module:build"], "No module named 'no_such_module'"),
        (["plan", "--sample-shape", "4,5"], "the built-in GPT brings its own token sample"),
        (["plan", "--devices", "cpu,meta", "--no-progress"], "device 'meta' holds no data"),
        (["simulate", "-K", "1000", "-M", "100000"], "use fewer stages or micro-batches"),
        (["bubble", "-M", "4", "10000000"], "use fewer stages or micro-batches"),
        (["simulate", "-K", "2", "-M", "2", "--trace", "/proc/no/t.json"], "cannot write"),
    ],
)
def test_bad_inputs_found_after_parsing_print_one_error_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    command = argv[0]
    assert captured.err.splitlines()[-1] == captured.err.strip()  # one line
    assert captured.err.startswith(f"gpipe {command}: error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_plan_imports_a_model_factory_from_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "usermodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "build.py").write_text(
        "from torch import nn\n\n\ndef make():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    argv = ["plan", "--model", "usermodels.build:make", "--sample-shape", "8"]
    assert main([*argv, "--stages", "2", "--schedules", "gpipe", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("RESULT best_schedule=gpipe")


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpipe {gpipe.__version__}" == "gpipe 0.1.0"


def _plan(chunks: int, step_ms: float, bubble: float) -> Plan:
    return Plan(4, chunks, "never", "gpipe", 1, [1] * 4, ["cpu"] * 4, step_ms / 1e3, bubble, [1])


def test_plan_says_why_one_micro_batch_won_and_what_the_others_cost() -> None:
    best, two, eight = _plan(1, 5.0, 0.75), _plan(2, 6.5, 0.6), _plan(8, 9.0, 0.27)
    rejected = [
        Rejection(two, "slower: +30.0%"),
        Rejection(eight, "over the memory budget by 1 MiB on device 0"),
        Rejection(_plan(4, 4.0, 0.4), "over the memory budget by 2 MiB on device 1"),
    ]
    lines = why_this_plan(PlanReport([best], rejected, 2**20))
    assert lines[0] == (
        "why M=1: gpipe, checkpoint never, predicted step at M=1 5.00 ms, M=2 6.50 ms, "
        "M=4 over the budget, M=8 over the budget"
    )
    assert lines[1].startswith("  M=1 leaves the largest bubble (75% of the devices' time idle)")
    assert "yet M=2 is predicted slower (6.50 ms against 5.00, bubble 60%)" in lines[1]


def test_plan_says_when_one_micro_batch_is_all_that_fits() -> None:
    rejected = [Rejection(_plan(2, 4.0, 0.6), "over the memory budget by 1 MiB on device 0")]
    lines = why_this_plan(PlanReport([_plan(1, 5.0, 0.75)], rejected, 2**20))
    assert lines[1] == "  M=1: no larger micro-batch count fits the memory budget"
