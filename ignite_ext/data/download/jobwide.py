"""One fetch per job: :func:`download_for_job`, the origin's bytes once for the whole job, relayed host to host.

Called on every rank, it runs :func:`~ignite_ext.data.download_url` in a
``rank_scheduler(order=SharedPath(root))`` block: one rank per physical directory (per host, for a node-local
``root``) makes its directory's copy while the others wait for it, as before. What changes is where those
*holders* get the bytes: it asks ``download_url`` to relay (``relay=True``), which a scheduled block of a job
written by hand may ask too (``one_rank_first(local=True)`` around ``download_url(..., relay=True)``, with one holder
per node); unasked, nothing is relayed and no port is opened. They join a chain through the job's
store (:mod:`._chain`) in the order they come: the first fetches from the origin, each next one from the one
before it, through that holder's relay (:mod:`._relay_server`), which serves its temp file *as it grows*. So the
bytes flow down the chain while the origin still sends them, and the origin serves them once.

**Time.** With the origin's rate ``R`` below the hosts' links ``B``, the chain carries the file at ``R``: holder
``k`` of ``H`` lags the first by about ``k`` relay buffers (the bytes a relay forwards in a round trip), so the last
copy is complete ``S / R + (H - 1) * d`` after the start, ``d`` a few milliseconds per hop, against ``H * S / R``
for ``H`` hosts sharing the origin one after the other, and ``S / R`` for one host alone. (A tree would cut the
``(H - 1) d`` term to ``log2(H) d`` but make each holder send ``fanout`` times what it receives: with ``R < B /
2`` it gains nothing, and a chain needs the fewest relay connections.)

**Verified, atomic, resumable, as every download.** Each holder writes its private temp file and publishes it
atomically after checking it: against the digest given, or without one, against the size and version the origin
named and the SHA-256 the origin's holder computed (posted once it published: every other copy must match it).
Bytes from two holders are joined only when both name the same version of the file (the origin's strong
validator). A crash leaves the temp file to resume, from the origin, as any download's.

**Failures.** A relay that closes, breaks or refuses is replaced at once by the holder before it (then the one
before that, then the origin); one that falls silent is waited for while its rank is alive, and given up when the
failure detector declares its rank lost (``4/3 T``). If the origin's holder gives up on the origin (its URLs and
mirrors), it posts its error, and every holder raises the same error once, without trying the origin itself.

**Only the job gets in.** A relay listens on the interface that reaches the job's store (the process group's),
serves that one file read-only, and only to a client that proves it holds the job's secret (32 random bytes in
the store, as trusted as the process group itself; never on a command line or in a log), proving it holds it in
turn (:mod:`._relay_wire`). It stops when its rank leaves the block: every rank has finished it by then, so every
directory has its copy.

.. versionadded:: 0.3.0
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from ignite_ext.data.download._verify import expected_digests
from ignite_ext.data.download.fetch import check_arguments, download_url, writable_root

__all__ = ["download_for_job"]


def download_for_job(
    url: str, root: str | os.PathLike[str], filename: str | None = None, md5: str | None = None, **options: Any
) -> Path:
    """Download ``url`` into ``root`` on every host of the job, fetching it from the origin once for the whole job.

    Call it on every rank (it is collective), in place of a ``rank_scheduler(order=SharedPath(root))`` block
    around :func:`~ignite_ext.data.download_url`, or of ``one_rank_first(local=True)`` around it when ``root`` is
    node-local. One rank per physical directory makes that directory's copy while the others of the directory
    wait; those copies come from the origin once and from host to host after that, relayed while they download
    (see the module docstring for the time, the checks and the security model). Without a process group, or on a
    backend without a store, it is :func:`~ignite_ext.data.download_url` in that block.

    Args:
        url: ``http``, ``https`` or ``file`` URL, as :func:`~ignite_ext.data.download_url` takes it.
        root: this rank's directory to download into (may differ between ranks: each host's own disk).
        filename: name of the file in ``root``; by default the last segment of the URL's path.
        md5: expected MD5 of the file, in hex.
        **options: every keyword argument of :func:`~ignite_ext.data.download_url` (``sha256``, ``mirrors``,
            ``extract``, ``timeout``, ``retries``, ``deadline``, ``connections``, ...), with the same meaning;
            ``relay`` is True here (``relay=False``: every directory's copy from the origin, no port opened).

    Returns:
        The path of the file on this rank, or with ``extract=True`` of the directory it was extracted into (each
        host extracts its own copy).

    Raises:
        DownloadError: the origin's holder gave up on the origin (every holder raises the same error, once), or
            this holder could not write its copy. The ranks that waited for their directory's holder raise
            :class:`~ignite_ext.distributed.RankFailedError` naming it, as in any scheduled block. Or, on every
            rank before anything is fetched, some rank's ``root`` cannot be made or written (the message names it).
        ChecksumError: the origin served bytes with another digest than the one given.
        ValueError: as :func:`~ignite_ext.data.download_url`, on every rank.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from ignite_ext.data import download_for_job
        >>> with tempfile.TemporaryDirectory() as tmp:  # one process: download_url in a block of one rank
        ...     _ = Path(tmp, "a.txt").write_text("a")
        ...     download_for_job(Path(tmp, "a.txt").as_uri(), Path(tmp, "data"), progress=False).read_text()
        'a'

    .. versionadded:: 0.3.0
    .. versionchanged:: 0.4.0
       A ``root`` that cannot be written is a :class:`~ignite_ext.errors.DownloadError` naming it, on every rank.
    """
    import ignite_ext.distributed as idist  # not at import: plain downloads need neither it nor torch
    from ignite_ext.distributed.agreement import disagreement

    options.setdefault("relay", True)  # download_url relays when asked (and IGNITE_EXT_RELAY is not 0)
    idist.agree(
        # Before the block: its SharedPath census writes into root, and would fail there in words of its own.
        lambda: _same_everywhere(url, filename, md5, options, root),
        "checking download_for_job's arguments and root",
        check=lambda keys: None if (d := disagreement(keys)) is None else f"the ranks passed different arguments: {d}",
    )
    # Asked to, download_url relays what it fetches in the block; its relays stop when this rank leaves it.
    with idist.rank_scheduler(order=idist.SharedPath(root)):
        return download_url(url, root, filename, md5, **options)


def _same_everywhere(
    url: str, filename: str | None, md5: str | None, options: dict[str, Any], root: str | os.PathLike[str]
) -> str:
    """Check the arguments and ``root`` as :func:`download_url` would; return what every rank must pass alike."""
    signature = inspect.signature(download_url)
    unknown = sorted(set(options) - set(signature.parameters) - {"url", "root", "filename", "md5"})
    if unknown:
        raise ValueError(f"download_for_job() got unexpected keyword arguments {unknown}")
    bound = signature.bind(url, ".", filename, md5, **options)
    bound.apply_defaults()
    args = dict(bound.arguments)
    mirrors = list(args["mirrors"])
    check_arguments(
        [url, *mirrors],
        args["timeout"],
        args["retries"],
        args["deadline"],
        args["connections"],
        args["low_speed_limit"],
        args["low_speed_time"],
    )
    expected_digests(sha256=args["sha256"], md5=md5)
    writable_root(root, url)
    del args["root"], args["progress"]  # a rank's own directory, and whether it shows a bar
    return repr(sorted((k, list(v) if k == "mirrors" else v) for k, v in args.items()))
