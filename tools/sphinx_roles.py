"""A griffe extension for the API reference: Sphinx roles in docstrings become links.

The docstrings say ``:class:`~gpipe.schedule.Schedule``` and ``:func:`simulate```, as
torchgpipe's do; mkdocstrings reads Google-style Markdown and would print the role as text.
Each role becomes an optional cross-reference (``<autoref optional>``): a link where the
target is on the site, plain code where it is not (a PyTorch name), never a build warning.
A bare name is looked up beside the docstring: in its class, then in its module.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([\w.]+)(\(\))?`"
)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles as optional autorefs."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None or ":" not in obj.docstring.value:
            return

        def link(match: re.Match[str]) -> str:
            short, target, call = match.group(1), match.group(2), match.group(3) or ""
            title = target.rsplit(".", 1)[-1] if short else target
            return (
                f'<autoref identifier="{_resolve(obj, target)}" optional>'
                f"<code>{title}{call}</code></autoref>"
            )

        obj.docstring.value = _ROLE.sub(link, obj.docstring.value)


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written beside ``obj``: itself when already dotted."""
    if "." in target:
        return target
    scopes = [obj, obj.parent, obj.module] if obj.parent is not None else [obj, obj.module]
    for scope in scopes:
        if scope is not None and target in scope.members:
            return f"{scope.path}.{target}"
    return target
