"""The package surface: names users import, and what importing costs."""

from __future__ import annotations

import importlib

import gpipe
from conftest import fresh_python


def test_public_names_resolve_to_functions_even_after_their_modules_load() -> None:
    # loading the modules must not shadow the functions of the same name
    importlib.import_module("gpipe.planning.planner")
    importlib.import_module("gpipe.balance.profiler")

    assert gpipe.plan.__module__ == "gpipe.planning.planner" and callable(gpipe.plan)
    assert gpipe.profile.__module__ == "gpipe.balance.profiler" and callable(gpipe.profile)
    for name in gpipe.__all__:
        assert getattr(gpipe, name) is not None


def test_importing_gpipe_does_not_load_torch_until_needed() -> None:
    code = (
        "import sys, gpipe\n"
        "from gpipe import simulate, make_schedule\n"
        "simulate(make_schedule('1f1b', 4, 8))\n"
        "print('torch' in sys.modules)\n"
    )
    assert fresh_python(code).strip() == "False"
