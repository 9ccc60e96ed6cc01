"""Put one backend's last-run summary into docs/backends_last_runs.md, replacing that backend's previous one.

Usage: python3 scripts/record_last_run.py NAME RUNS_FILE SUMMARY_FILE (the summary is fenced by
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``).
"""

import re
import sys
from pathlib import Path

name, runs, summary_file = sys.argv[1:4]
summary = Path(summary_file).read_text().strip()
text = Path(runs).read_text() if Path(runs).exists() else "# Backend matrix: last runs\n"
pattern = re.compile(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", re.S)
text = pattern.sub(lambda _: summary, text) if pattern.search(text) else text.rstrip() + "\n\n" + summary + "\n"
Path(runs).write_text(text)
