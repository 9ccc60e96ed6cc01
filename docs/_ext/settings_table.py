"""The settings page's tables, drawn from :mod:`ignite_ext.settings` when the docs are built.

``.. settings-table:: user`` (or ``internal``) becomes a table of the registered variables for that audience, in
the registry's order, so the page cannot drift from what the package reads.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from ignite_ext import settings

__all__ = ["SettingsTable", "setup", "table_lines"]

COLUMNS = ("Variable", "Default", "Unit", "Accepts", "What it changes")


def table_lines(audience: str) -> list[str]:
    """The reStructuredText of the table of ``audience``'s settings (``ValueError`` if there are none)."""
    rows = [s for s in settings.REGISTRY.values() if s.audience == audience]
    if not rows:
        raise ValueError(f"no setting is for {audience!r}: expected {settings.USER!r} or {settings.INTERNAL!r}")
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 30 15 9 20 26", ""]
    for cells in [COLUMNS, *((f"``{s.name}``", s.shown_default(), s.unit, s.accepts, s.changes) for s in rows)]:
        lines += [f"   * - {cells[0]}", *(f"     - {cell}" for cell in cells[1:])]
    return lines


class SettingsTable(SphinxDirective):
    """``.. settings-table:: <audience>``: the registry's table for that audience."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        """The table's nodes, parsed from :func:`table_lines`."""
        self.env.note_dependency(settings.__file__)  # the page is rebuilt when the registry changes
        holder = nodes.container()
        lines = table_lines(self.arguments[0])
        self.state.nested_parse(StringList(lines, source=settings.__file__), self.content_offset, holder)
        return list(holder.children)


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive."""
    app.add_directive("settings-table", SettingsTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
