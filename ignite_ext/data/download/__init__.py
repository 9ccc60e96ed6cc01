"""Race-free, resumable, verified downloads and safe, atomic extraction: :func:`download_url`, :func:`extract_archive`.

How one file gets from a URL to ``root/filename``, whatever else runs at the same time, is described in
:mod:`ignite_ext.data.download.fetch`; the member checks and the atomic publish of an extraction in
:mod:`ignite_ext.data.download.extract`. The modules of this package:

* ``fetch``: :func:`download_url`: lock, private temp file, resume, verify, atomic publish;
* ``jobwide``: :func:`download_for_job`: the origin's bytes once per job, relayed host to host; ``_relaying``
  (a holder's side), ``_chain`` (who fetches from whom, through the job's store), ``_relay_server`` and
  ``_relay_client`` (serving a growing file, receiving it), ``_relay_wire`` (the mutual proof of the job's
  secret);
* ``_partial``: a writer's private temp file, and taking over what a dead writer left;
* ``_verify``: expected digests, hashing, the record of a verified file;
* ``_http``: conditional range requests and the retry policy (urllib only);
* ``extract`` and ``_members``: :func:`extract_archive` and the member checks;
* ``cli``: ``python -m ignite_ext download``.

Importing it imports neither torch nor numpy, and nothing platform-specific.

.. versionadded:: 0.1.0
"""

from ignite_ext.data.download.cli import add_cli_arguments, cli
from ignite_ext.data.download.extract import DEFAULT_MAX_TOTAL_BYTES, archive_stem, extract_archive
from ignite_ext.data.download.fetch import ORPHAN_MAX_AGE_S, download_url
from ignite_ext.data.download.jobwide import download_for_job
from ignite_ext.errors import ArchiveError, ChecksumError, DownloadError

__all__ = [
    "DEFAULT_MAX_TOTAL_BYTES",
    "ORPHAN_MAX_AGE_S",
    "ArchiveError",
    "ChecksumError",
    "DownloadError",
    "add_cli_arguments",
    "archive_stem",
    "cli",
    "download_for_job",
    "download_url",
    "extract_archive",
]
