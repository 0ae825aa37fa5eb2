"""The first step's timeline shows the step: one-time imports happen when the pipe is built."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

# A fresh interpreter: the test process has long imported everything.
PROGRAM = """
import json, sys
import torch
from torch import nn
from gpipe import GPipe

model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4))
pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
built = set(sys.modules)
x = torch.randn(4, 4)
pipe.train_step(x, x, nn.functional.mse_loss)
print(json.dumps(sorted(set(sys.modules) - built)))
"""


def test_the_first_step_imports_no_compiler_modules() -> None:
    # Two stages in one process share the CPU generator, so their layers are probed under
    # a dispatch mode, whose first entry imports torch._dynamo (1-8 s): at construction.
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": str(Path(sys.executable).parent)},
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.splitlines()[-1])
    assert not [name for name in imported if name.startswith("torch._dynamo")], imported
