"""Printing a benchmark's result as a plain table, for runs of a single benchmark module."""

from __future__ import annotations

from typing import Any


def print_result(result: dict[str, Any]) -> None:
    rows = result["rows"]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    widths = [max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys]
    print(result["title"])
    print(result["machine"])
    print(" | ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r.get(k, "")).ljust(w) for k, w in zip(keys, widths, strict=True)))
    print(result["summary"])
