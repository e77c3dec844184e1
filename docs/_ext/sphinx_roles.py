"""Griffe extension for the docs build: Sphinx roles in docstrings become inline code.

The packages' docstrings are also read with ``help()``, where ``:class:`Backend``` is common
usage; on the site the role would show as literal text, so ``:class:`X``` renders as ``X``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|obj|data|exc|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` to ```target``` in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
