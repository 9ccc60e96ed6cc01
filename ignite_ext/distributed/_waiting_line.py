"""On a terminal, one line per node says what its ranks wait for, rewritten in place.

A waiting rank logs a line every log interval (30 s): in a job's log file that is what an operator reads. On a
terminal (``torchrun`` in a shell), a line per rank every 30 s is both too slow to follow a download and too many
lines: there the node's local rank 0 rewrites one line with the awaited rank's progress at each beat interval, and
the node's other ranks, which wait for the same first ranks, stay quiet. What it costs: the refreshing rank's wait
is cut into slices of a beat interval (``T / 6``), each a few store requests (the wait, the wake key's reset, the
awaited outcome's and progress's reads), on local rank 0 of a node whose standard error is a terminal only:
``O(nodes on a terminal / beat interval)`` requests per second, nothing in a job whose output goes to files.

``IGNITE_EXT_WAITING_LINE``: ``auto`` (the default: on a terminal), ``0`` (never: the log lines only, as in files);
the docs' settings page (:doc:`/settings`) lists it with the package's other variables.

.. versionadded:: 0.4.0
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

from ignite_ext.settings import WAITING_LINE

__all__ = ["WaitingLine", "waiting_line_role"]

#: No line here: log every log interval, as with files.
LOG = "log"
#: This rank rewrites its node's line.
SHOW = "show"
#: Another rank of the node shows the line: nothing from this one while it waits.
QUIET = "quiet"


def waiting_line_role(local_rank: int, stream: TextIO | None = None) -> str:
    """What this rank does while it waits: :data:`LOG`, :data:`SHOW` or :data:`QUIET`.

    Examples:
        >>> import io
        >>> from ignite_ext.distributed._waiting_line import waiting_line_role
        >>> waiting_line_role(0, io.StringIO())  # not a terminal: log lines
        'log'

    .. versionadded:: 0.4.0
    """
    if not WAITING_LINE.read():
        return LOG
    stream = sys.stderr if stream is None else stream
    try:
        on_terminal = stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        on_terminal = False
    if not on_terminal:
        return LOG
    return SHOW if local_rank == 0 else QUIET


class WaitingLine:
    r"""One line of a terminal, rewritten in place, ended with a newline once the wait is over.

    Examples:
        >>> import io
        >>> from ignite_ext.distributed._waiting_line import WaitingLine
        >>> out = io.StringIO()
        >>> line = WaitingLine(out, width=40)
        >>> line.show("rank 1 waits 2 s for rank 0"); line.show("rank 1 waits 4 s for rank 0"); line.end()
        >>> out.getvalue().split("\r")[-1]
        '\x1b[Krank 1 waits 4 s for rank 0\n'

    .. versionadded:: 0.4.0
    """

    def __init__(self, stream: TextIO | None = None, width: int | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width if width is not None else shutil.get_terminal_size((100, 24)).columns
        self.shown = False

    def show(self, text: str) -> None:
        """Replace the line with ``text``, cut to the terminal's width (a wrapped line could not be rewritten)."""
        if len(text) >= self.width:
            text = text[: max(1, self.width - 2)] + "…"
        try:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: the wait goes on without its line
            return
        self.shown = True

    def end(self) -> None:
        """Leave the last text on its line, so the next output starts on a line of its own."""
        if self.shown:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self.shown = False
