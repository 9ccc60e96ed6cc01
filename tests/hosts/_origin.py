"""An origin on a simulated host: ``python -m tests.hosts._origin IP FILE OUT`` serves ``FILE`` at ``/data.bin``.

The fault-injecting server of the download tests (``benchmarks.http_server``), bound to the host's address. It
writes its URL to ``OUT/origin.url`` once it listens, then, every 0.1 s, the body bytes it has sent and the
requests it has answered to ``OUT/origin.json`` (by an atomic rename), until it is killed with its host.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.http_server import TestHTTPServer

__all__ = ["main"]


def _publish(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    ip, file, out = argv[0], Path(argv[1]), Path(argv[2])
    server = TestHTTPServer(host=ip)
    url = server.add("/data.bin", file.read_bytes())
    _publish(out / "origin.url", url)
    while True:
        requests = server.requests("/data.bin")
        record = {"bytes": sum(r.sent for r in requests), "requests": [[r.range, r.status, r.sent] for r in requests]}
        _publish(out / "origin.json", json.dumps(record))
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1:])
