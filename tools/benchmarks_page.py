"""Run every benchmark in benchmarks/ and write docs/benchmarks.md from what they printed.

    python tools/benchmarks_page.py --run            # every benchmark (20-30 min on 2 cores)
                                                     # but the GPU check, kept as saved
    python tools/benchmarks_page.py --run latency    # some of them; the others keep their runs
    python tools/benchmarks_page.py                  # rewrite the page from the saved runs

Each run is saved as ``benchmarks/runs/NAME.txt``: the command, the machine, the time and
load average at its start and end, and everything it printed. The page shows each one
verbatim under the command that printed it, so every table in the docs can be reproduced.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RUNS = BENCHMARKS / "runs"
PAGE = ROOT / "docs" / "benchmarks.md"
# Imported by the others; they print nothing of their own.
HELPERS = {"torch_reference", "host", "plan_models"}
# Runs this page shows from their saved report but never reruns: they need a GPU this host
# lacks, and a rerun here would replace the GPU's figures the docs cite.
SAVED_ONLY = {"gpu_check"}
# Runs that need arguments, or a second way to run a script: run name -> (script, arguments).
VARIANTS = {
    "compute": ("compute", ["--distributed", "--steps", "15"]),
    "compute_layouts": ("compute", ["--distributed", "--dp", "2", "--pp", "2"]),
    "compute_layers": ("compute", ["--distributed", "--layers"]),
    "latency_distributed": (
        "latency_distributed",
        ["--stages", "2", "4", "--microbatches", "8", "16"],
    ),
    "overhead_serial": ("overhead", ["--serial"]),
    "overhead_turns": (
        "overhead",
        ["--no-one-stage", "--stages", "4", "--turns", "5", "--no-torch"],
    ),
    "schedules_distributed": ("schedules", ["--runtime", "distributed", "--microbatches", "8"]),
    "skip_distributed": ("skip", ["--distributed"]),
}

INTRO = """\
# Benchmarks

Every table the scripts in `benchmarks/` print, as they printed it, under the command that
printed it and the machine it ran on. Each script compares with the ideal and, where
PyTorch has the schedule, with `torch.distributed.pipelining` in the same run, and ends
with a `RESULT key=value ...` line. The machine here is a shared 2-core CPU box: wall-clock
figures move with the load average shown; the ratios within one run are what to read.
Rebuild this page with `python tools/benchmarks_page.py --run` (see its docstring).
"""


def names() -> list[str]:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS}
    return sorted(scripts | set(VARIANTS))


def rerunnable() -> list[str]:
    """The runs ``--run`` may run: every one but those kept as saved."""
    return [name for name in names() if name not in SAVED_ONLY]


def command(name: str) -> list[str]:
    """The script and arguments of run ``name``."""
    script, arguments = VARIANTS.get(name, (name, []))
    return [f"benchmarks/{script}.py", *arguments]


def machine() -> str:
    import torch

    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def run(name: str) -> None:
    """Run one benchmark and save what it printed, with where and when."""
    if name in SAVED_ONLY:
        raise ValueError(f"{name} is kept as saved (SAVED_ONLY); this page never reruns it")
    RUNS.mkdir(exist_ok=True)
    began = time.time()
    header = [
        f"CMD python {' '.join(command(name))}",
        f"MACHINE {machine()}",
        f"START {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))} load {load()}",
    ]
    done = subprocess.run(
        [sys.executable, *command(name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    footer = [
        f"EXIT {done.returncode}",
        f"ELAPSED {time.time() - began:.0f} s",
        f"END load {load()}",
    ]
    text = "\n".join([*header, done.stdout.rstrip(), *footer]) + "\n"
    if done.returncode:
        text += "STDERR\n" + "\n".join(done.stderr.strip().splitlines()[-15:]) + "\n"
    (RUNS / f"{name}.txt").write_text(text)


def section(name: str) -> str:
    """The page's section for one benchmark, from its saved run."""
    path = RUNS / f"{name}.txt"
    script = ROOT / command(name)[0]
    doc = script.read_text().split('"""')[1].strip().splitlines()[0]
    if not path.exists():
        rerun = f"python tools/benchmarks_page.py --run {name}"
        return f"## {name}\n\n{doc}\n\nNot run yet: `{rerun}`.\n"
    fields: dict[str, str] = {}
    body: list[str] = []
    stderr: list[str] = []
    target = body
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(" ")
        if key in ("CMD", "MACHINE", "START", "EXIT", "ELAPSED", "END") and target is body:
            fields[key] = rest
        elif line == "STDERR":
            target = stderr
        else:
            target.append(line)
    start_load = fields.get("START", "").partition(" load ")[2]
    parts = [
        f"## {' '.join(command(name)).removeprefix('benchmarks/')}",
        doc,
        f"`{fields.get('CMD', '')}` — ran {fields.get('START', '').partition(' load ')[0]} on "
        f"{fields.get('MACHINE', '?')}; load average {start_load} at the start, "
        f"{fields.get('END', '').removeprefix('load ')} at the end; "
        f"{fields.get('ELAPSED', '?')}.",
        "```text\n" + "\n".join(body).strip("\n") + "\n```",
    ]
    if fields.get("EXIT", "0") != "0":
        parts.append(
            f"**It failed** (exit code {fields['EXIT']}); the end of what it said:\n\n"
            "```text\n" + "\n".join(stderr).strip() + "\n```"
        )
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs="*", metavar="NAME", help="run these (all if none)")
    args = parser.parse_args()
    if args.run is not None:
        kept = SAVED_ONLY.intersection(args.run)
        if kept:
            parser.error(
                f"{', '.join(sorted(kept))}: saved only, never rerun here (see SAVED_ONLY)"
            )
        for name in args.run or rerunnable():
            print(f"running benchmarks/{name}.py ...", flush=True)
            run(name)
    PAGE.write_text(INTRO + "\n" + "\n".join(section(name) for name in names()))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
