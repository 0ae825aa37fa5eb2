"""The errors of :func:`gpipe.split`: a model torch.fx cannot follow, told in the user's terms."""

from __future__ import annotations

import os
import traceback

import torch

__all__ = ["UntraceableError", "is_user_frame", "untraceable"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_GPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a torch.fx Proxy method that refuses means in the user's code.
_OPERATIONS = {
    "__bool__": "a traced tensor used as a Python bool (an `if`, `while`, `and` or `assert` "
    "on a value that depends on the input)",
    "__iter__": "iteration over a traced value whose length depends on the input",
    "__len__": "len() of a traced value",
    "keys": "a traced value used as a mapping (`**x`)",
}


class UntraceableError(ValueError):
    """torch.fx could not follow the model's forward: the message names the operation, the
    source line and the submodule, and says how to proceed (``leaf_modules``).

    Attributes:
        module: the qualified name of the innermost submodule being traced ("" for the
            model's own forward).
        line: ``"file:line"`` of the user's code that failed, or "" if unknown.
    """

    def __init__(self, message: str, module: str, line: str) -> None:
        super().__init__(message)
        self.module = module
        self.line = line


def is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_GPIPE_DIR))


def untraceable(error: BaseException, module: str, module_type: type | None) -> UntraceableError:
    """The :class:`UntraceableError` for ``error``, raised while tracing submodule ``module``.

    Args:
        error: what torch.fx (or the model's code on a traced value) raised.
        module: the innermost submodule being traced ("" for the model itself).
        module_type: its class, if known.
    """
    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if is_user_frame(f.filename)]
    fx_methods = [f.name for f in frames if not is_user_frame(f.filename)]
    operation = next(
        (_OPERATIONS[name] for name in reversed(fx_methods) if name in _OPERATIONS),
        f"an operation torch.fx cannot trace ({type(error).__name__}: {error})",
    )
    line, where = "", "the model's code"
    if user:
        frame = user[-1]
        line = f"{frame.filename}:{frame.lineno}"
        code = (frame.line or "").strip()
        where = f"{line} in {frame.name}(): `{code}`" if code else f"{line} in {frame.name}()"
    if module:
        owner = f"submodule {module!r} ({module_type.__name__ if module_type else '?'})"
        type_hint = f" (or its type, leaf_modules=[{module_type.__name__}])" if module_type else ""
        fix = (
            f"mark it a leaf so it is called as a whole, without tracing inside it (control "
            f"flow inside a leaf is fine): gpipe.split(..., leaf_modules=[{module!r}])"
            f"{type_hint}; or move just that code into its own submodule (an nn.Module or an "
            "nn.Sequential) and list that one in leaf_modules"
        )
    else:
        owner = "the model's own forward (outside any submodule)"
        fix = (
            "move that code into a submodule of its own (an nn.Module or an nn.Sequential) "
            "and list it in gpipe.split(..., leaf_modules=[...]), so it is called as a whole"
        )
    message = (
        f"gpipe.split cannot trace the model with torch.fx: {operation}, at {where}, in "
        f"{owner}. To proceed, {fix}. A leaf cannot be cut inside."
    )
    return UntraceableError(message, module, line)
