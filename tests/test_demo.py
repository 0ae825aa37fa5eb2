"""`gpipe demo`: trains on real text, writes every file it promises, refuses bad options."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from gpipe.cli import main
from gpipe.demo.recipe import PROMPTS, Corpus, DemoSettings
from gpipe.demo.speeches import write_speeches
from gpipe.demo.training import build_model


def result_of(out: str) -> dict[str, str]:
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return dict(item.split("=", 1) for item in line.split()[1:])


def check_outputs(out: str, folder: Path, *, stages: int) -> dict[str, str]:
    """The demo's promises: loss falls, the bubble sits beside its formula, files hold data."""
    result = result_of(out)
    assert int(result["stages"]) == stages
    assert float(result["val_end"]) < float(result["val_start"])
    assert float(result["last_loss"]) < float(result["first_loss"])
    formula = (stages - 1) / (8 + stages - 1)
    assert float(result["bubble_formula"]) == pytest.approx(formula, abs=1e-4)
    for name in ("bubble", "bubble_profiled", "bubble_predicted"):
        assert 0 <= float(result[name]) < 1, name
    assert float(result["plain_step"]) > 0 and float(result["pipe_step"]) > 0
    assert "ROMEO:" in out and "plain training" in out
    # the speeches: written through the pipe, and alike by the plain model in one process
    assert result["speeches_same"] == "yes"
    assert "MACBETH:" in out and "the same speeches both ways, to the character" in out
    assert float(result["generate_seconds"]) > 0 and float(result["plain_generate_seconds"]) > 0
    # the pipe against plain training: a verdict, or why this run cannot tell
    assert re.search(r"the pipe (costs|is) .*x|this run cannot tell plain training", out)
    assert "turns, load " in out
    for name in ("timeline.png", "loss.png", "generation.png"):
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    trace = json.loads((folder / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # Every forward and backward of the last step: K stages x M micro-batches x 2.
    slices = [e for e in events if e.get("ph") == "X"]
    assert len(slices) >= stages * 8 * 2
    report = (folder / "report.md").read_text()
    assert "![loss curve](loss.png)" in report
    assert "![measured and predicted timeline](timeline.png)" in report
    assert "ROMEO:" in report and "Both ways wrote the same speeches" in report
    assert "(generation.png)" in report
    return result


def test_demo_learns_shakespeare_and_writes_every_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    argv = ["demo", "--steps", "8", "--batch", "8", "--out", str(out_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    check_outputs(out, out_dir, stages=4)
    assert "balance [2, 1, 1, 3]" in out  # the four blocks alike, cut by parameters


@pytest.mark.parametrize("schedule", ["auto", "zb-h1"])
def test_demo_runs_schedules_without_a_textbook_formula(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, schedule: str
) -> None:
    argv = ["demo", "--steps", "2", "--batch", "8", "--schedule", schedule]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    result = result_of(capsys.readouterr().out)
    assert 0 <= float(result["bubble"]) < 1
    assert (tmp_path / "report.md").exists()


def test_the_demo_pipe_writes_the_plain_models_speeches_on_a_v_shaped_layout() -> None:
    # two stages per device, folded as a V: the lanes still take the turn the plain model copies
    settings = DemoSettings(stages=3, schedule="zb-v")
    corpus = Corpus.load(settings.seed)
    speeches = write_speeches(settings, corpus, build_model(settings, corpus), [1, 1, 1, 1, 1, 2])
    assert speeches.piped == speeches.plain
    assert [speech.split("\n")[0] + "\n" for speech in speeches.piped] == list(PROMPTS)
    assert len(speeches.piped[-1]) == corpus.config.context  # the longest prompt fills it
    assert speeches.stats.lanes == len(PROMPTS) and len(speeches.stats.cache_bytes) == 6


def test_distributed_demo_writes_the_same_files_from_two_processes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    argv = ["demo", "--distributed", "2", "--steps", "6", "--batch", "8", "--out", str(out_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    check_outputs(out, out_dir, stages=2)
    assert "2 processes" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "99"], "--stages 99 needs 99 stages, but the model has 7 layers: use "),
        (
            ["--schedule", "interleaved"],
            "--stages 4 (x 2 stages per device for interleaved) needs 8 stages, but the model "
            "has 7 layers: use --stages <= 3",
        ),
        (
            ["--batch", "3", "--chunks", "8"],
            "--batch 3 cannot make 8 micro-batches of at least one sample: use --batch >= 8 "
            "or --chunks <= 3",
        ),
        (["--distributed", "2", "--stages", "3"], "drop --stages, or use --distributed 3"),
    ],
)
def test_bad_demo_settings_print_one_error_naming_the_fix(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["demo", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpipe demo: error: ") and err.count("\n") == 1
    assert message in err


def test_demo_refuses_an_output_folder_that_is_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["demo", "--steps", "1", "--out", str(taken)]) == 2
    assert f"--out {taken} is a file: give a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunks", "0"], "expected a whole number >= 1, got 0"),
        (["--steps", "-1"], "expected a whole number >= 1, got -1"),
        (["--distributed", "x"], "expected a whole number >= 1, got 'x'"),
        (["--schedule", "fast"], "invalid choice: 'fast'"),
        (["--checkpoint", "some"], "invalid choice: 'some'"),
    ],
)
def test_demo_options_of_the_wrong_form_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_refuses_an_unwritable_output_folder_before_training(
    capsys: pytest.CaptureFixture[str],
) -> None:
    began = time.perf_counter()
    # /proc refuses new folders even to root, so the check cannot pass by privilege
    assert main(["demo", "--out", "/proc/gpipe-demo-out"]) == 2
    # a hang check (usually 0.01 s; training the 250 default steps would take minutes)
    assert time.perf_counter() - began < 30
    assert "cannot write to --out /proc/gpipe-demo-out" in capsys.readouterr().err
