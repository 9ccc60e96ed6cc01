"""Run every benchmark; write JSON, markdown and PNG per benchmark, and the docs' results section.

Usage: ``python -m benchmarks.run_all [--quick] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shutil
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"


def _modules() -> list[Any]:
    names = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))
    return [importlib.import_module(f"benchmarks.{n}") for n in names]


def _table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return keys, [[str(row.get(k, "")) for k in keys] for row in rows]


def _markdown(result: dict[str, Any]) -> str:
    keys, cells = _table(result["rows"])
    lines = [f"## {result['title']}", "", f"Machine: {result['machine']}", ""]
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join([*lines, "", result["summary"], ""])


def _rst(name: str, result: dict[str, Any], has_plot: bool) -> str:
    keys, cells = _table(result["rows"])
    out = [result["title"], "~" * len(result["title"]), "", f"Machine: {result['machine']}", ""]
    out += [".. list-table::", "   :header-rows: 1", ""]
    for row in [keys, *cells]:
        out += [("   * - " if i == 0 else "     - ") + (c or " ") for i, c in enumerate(row)]
    out += ["", result["summary"], ""]
    if has_plot:
        out += [f".. image:: benchmarks/{name}.png", f"   :alt: {result['title']}", ""]
    return "\n".join(out)


def _plot(result: dict[str, Any], path: Path) -> bool:
    spec = result.get("plot")
    if not spec:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if spec.get("complete_rows"):  # only the rows that have every plotted value (a table of several measures)
        rows = [r for r in rows if all(k in r for k in spec["y"])]
    labels = [str(r[spec["x"]]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 3.6))
    width = 0.8 / len(spec["y"])
    for i, key in enumerate(spec["y"]):
        values = [float(r.get(key, 0) or 0) for r in rows]
        if spec.get("kind") == "line":
            ax.plot(labels, values, marker="o", label=key)
        else:
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=key)
    if spec.get("kind") != "line":
        ax.set_xticks([x + width * (len(spec["y"]) - 1) / 2 for x in range(len(labels))], labels, rotation=20)
    ax.set_title(result["title"], fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs (minutes instead of tens of minutes)")
    parser.add_argument("--only", nargs="*", help="benchmark names to run (default: all)")
    args = parser.parse_args()
    # torch's store server looks up the name of every client that connects (a reverse DNS query, for 127.0.0.1
    # too), one after the other, and a resolver that loses queries stalls it 5-10 s each: hundreds of simulated
    # ranks connecting at once wait minutes. Lookups go over TCP, as in the tests (docs/testing.rst): on these
    # machines they then fail at once, and /etc/hosts still answers.
    os.environ.setdefault("RES_OPTIONS", "use-vc")
    RESULTS.mkdir(exist_ok=True)
    (DOCS / "benchmarks").mkdir(exist_ok=True)
    for module in _modules():
        if args.only and module.NAME not in args.only:
            continue
        print(f"[benchmarks] {module.NAME} ...", flush=True)
        start = time.perf_counter()
        result = module.run(quick=args.quick)
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["quick"] = args.quick
        (RESULTS / f"{module.NAME}.json").write_text(json.dumps(result, indent=2))
        (RESULTS / f"{module.NAME}.md").write_text(_markdown(result))
        if _plot(result, RESULTS / f"{module.NAME}.png"):
            shutil.copy(RESULTS / f"{module.NAME}.png", DOCS / "benchmarks" / f"{module.NAME}.png")
        print(result["summary"], flush=True)
    sections = ["Results", "-------", ""]
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        if "title" not in result:  # not a bench_ module's result (the fault sweep's table has a page of its own)
            continue
        run_kind = "quick run" if result.get("quick") else "full run"
        result["summary"] = f"{result['summary']} ({run_kind}, {result['seconds']} s)"
        sections.append(_rst(path.stem, result, (DOCS / "benchmarks" / f"{path.stem}.png").exists()))
    (DOCS / "benchmarks_results.rst").write_text("\n".join(sections))


if __name__ == "__main__":
    main()
