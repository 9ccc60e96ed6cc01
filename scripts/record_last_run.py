"""Record one backend's last run in docs/backends_last_runs.md, replacing that backend's previous record.

Usage: python3 scripts/record_last_run.py NAME TITLE HEADLINE STATUS LOG RUNS_FILE

The record holds the title, the headline (when, where, which versions), pytest's exit status, its per-test lines
and its last line, fenced by ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``.
"""

import re
import sys
from pathlib import Path

name, title, headline, status, log, runs = sys.argv[1:7]
lines = Path(log).read_text(errors="replace").splitlines() if Path(log).exists() else []
tests = [line.split(" - ")[0] for line in lines if re.match(r"^(PASSED|FAILED|ERROR|SKIPPED)", line)]
record = "\n".join(
    [
        f"<!-- {name}:begin -->",
        f"## {title}",
        "",
        headline,
        f"pytest exit status: {status}.",
        "",
        "```",
        *tests,
        *(lines[-1:] if lines else []),
        "```",
        f"<!-- {name}:end -->",
    ]
)
text = Path(runs).read_text() if Path(runs).exists() else "# Backend matrix: last runs\n"
pattern = re.compile(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", re.S)
text = pattern.sub(lambda _: record, text) if pattern.search(text) else text.rstrip() + "\n\n" + record + "\n"
Path(runs).write_text(text)
