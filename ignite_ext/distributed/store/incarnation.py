"""Which incarnation of a torchrun group a process belongs to, and a store of that incarnation's own.

torchrun's agent keeps one store for every attempt of a job (``TORCHELASTIC_USE_AGENT_STORE``): a restarted
group's workers are new clients of the same server, and torch gives them no per-attempt prefix. Every key of the
attempt before is still there when the next one starts: gloo's peer addresses (a restarted rank reads a dead
peer's address and its ``connectFullMesh`` is refused: 5 restarts in 12 with one agent, 8 in 10 with two, plain
torch 2.13 on a 2-core machine) and the package's own keys (a block's entries and exit counts). So the package
puts the store of every incarnation under a prefix of its own, before torch forms the group on it:

* :func:`install` wraps torch's ``env://`` rendezvous (what ``idist.initialize``, ``idist.Parallel`` and a plain
  ``init_process_group`` under torchrun use), so that gloo's keys and the package's are never read across
  attempts;
* :func:`scoped` is what it applies, and what :func:`~ignite_ext.distributed.store.clients.group_store` applies to a
  group formed before the package was imported (gloo's keys are then torch's business; the package's own are
  still per incarnation).

An incarnation is named by the round of torch's c10d rendezvous, the one number every agent of a multi-node job
agrees on: an agent whose workers were healthy restarts them without counting a restart, so
``TORCHELASTIC_RESTART_COUNT`` differs across nodes. The workers' store (``MASTER_PORT``) is another server than
the rendezvous', so a rank reads the round where its agent does: the agent's ``--rdzv-endpoint`` (its command
line, read by torch's own parser), one connection and one read per node and incarnation (the first worker of a
start reads, its siblings find its note in the directory the agent made for that start). With one agent
(``--standalone``, a single node) its restart count names the incarnation, and so it does with torchrun's default
static rendezvous (``--node-rank``), whose agents restart only when their own workers fail: each incarnation costs
every node one restart. With several agents of another backend (etcd), nothing names it, and the store is left as
torch made it (the backends page says so).

Nothing connects at import.

.. versionadded:: 0.5.0
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import importlib
import io
import os
import pickle
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ignite_ext.distributed.store.keys import incarnation_prefix
from ignite_ext.distributed.store.wire import read

#: How torchrun appears in its agent's command line (``torchrun`` or ``python -m torch.distributed.run``).
RUNNERS = ("torchrun", "torch.distributed.run")
RUNNER_PATHS = ("/torchrun", "/torch/distributed/run.py")

if TYPE_CHECKING:  # torch declares them in the stub of its extension, and exports them from torch.distributed
    from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
else:
    from torch.distributed import PrefixStore, Store, TCPStore

__all__ = ["NOTE", "READ_TIMEOUT", "RUNNERS", "RUNNER_PATHS", "incarnation", "install", "is_scoped", "scoped"]

_SCOPED: weakref.WeakSet[Store] = weakref.WeakSet()


def _agent_arguments() -> argparse.Namespace | None:
    """The arguments of the torchrun agent that started this worker (its parent), as torch's own parser reads them.

    A worker is its agent's child; torchrun tells it neither its rendezvous backend nor where the rendezvous is
    served (the store it gives, at ``MASTER_PORT``, is another server). The parser also reads the ``PET_``
    variables the worker inherited.
    """
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0")[:-1]]
        at = next(i for i, a in enumerate(argv) if a in RUNNERS or a.endswith(RUNNER_PATHS))
        parser = importlib.import_module("torch.distributed.run").get_args_parser()
        args, _ = parser.parse_known_args(argv[at + 1 :])
    except (OSError, StopIteration, SystemExit, ImportError, AttributeError, UnicodeDecodeError):
        return None
    return args if isinstance(args, argparse.Namespace) else None


def _rendezvous_endpoint(args: argparse.Namespace) -> tuple[str, int] | None:
    """Where the agents' c10d rendezvous is served (None for another backend, or ``--standalone``'s own port)."""
    endpoint = str(getattr(args, "rdzv_endpoint", "") or "")
    if getattr(args, "standalone", False) or getattr(args, "rdzv_backend", "") != "c10d" or not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():  # torch's default port of the c10d rendezvous
        host, port = endpoint, "29400"
    return (host.strip("[]"), int(port)) if int(port) else None


class _StateUnpickler(pickle.Unpickler):
    """Reads the agents' pickled rendezvous state, and nothing else.

    Anyone who reaches the rendezvous port can write its key, and a pickle of another class would run code in
    every worker that reads it.
    """

    ALLOWED = {"torch.distributed.elastic.rendezvous.dynamic_rendezvous": None, "datetime": {"datetime", "timezone",
               "timedelta"}, "builtins": {"set", "frozenset", "dict", "list", "tuple"}}  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        names = self.ALLOWED.get(module, set())
        if module not in self.ALLOWED or (names is not None and name not in names):
            raise pickle.UnpicklingError(f"not a rendezvous state: {module}.{name}")
        return super().find_class(module, name)


#: How long a rank waits to reach its agents' rendezvous store (its own agent joined through it moments ago).
READ_TIMEOUT = timedelta(seconds=30)
#: The file, in the agent's directory of this start of its workers, where the first of them leaves what it read.
NOTE = "ignite_ext-rendezvous-round"


def _rendezvous_round(run_id: str, endpoint: tuple[str, int]) -> int | None:
    """The round of torch's c10d rendezvous that started this process, read from its state (one request).

    Raises:
        ConnectionError: the rendezvous store did not answer. Falling back to no name would leave this rank out of
            the group its peers form under the round's name (a wait to the group's timeout), so it fails at once.
    """
    key = f"torch.rendezvous.{run_id}"  # torch's C10dRendezvousBackend's key; read, never written
    try:
        store = TCPStore(*endpoint, is_master=False, timeout=READ_TIMEOUT, wait_for_workers=False)
        raw = read(store, key)  # one request on every torch (2.1's stores have no check)
    except Exception as e:  # torch raises RuntimeError, DistStoreError or OSError by release
        where = f"{endpoint[0]}:{endpoint[1]}"
        raise ConnectionError(f"could not read torchrun's rendezvous round at {where} (--rdzv-endpoint): {e}") from e
    try:  # a torch that changed the key or its format: no name on any rank, as torch made the store
        state = _StateUnpickler(io.BytesIO(base64.b64decode(raw))).load() if raw is not None else None
    except Exception:
        return None
    found = getattr(state, "round", None)
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _start_directory() -> str | None:
    """The directory torchrun's agent made anew for this start of its workers, if it is this user's.

    The agent removes and re-creates ``<log dir>/<run>/attempt_<n>/`` before each start (a restart after a
    membership change keeps ``n``) and gives each worker ``attempt_<n>/<local rank>/error.json``: what a worker
    leaves there is seen by its siblings, and never by the workers of another start.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    rank_dir = os.path.dirname(error_file)
    start = os.path.dirname(rank_dir)
    if not error_file or os.path.basename(rank_dir) != os.environ.get("LOCAL_RANK", "-"):
        return None
    if not os.path.basename(start).startswith("attempt_"):
        return None
    try:
        return start if os.stat(start).st_uid == os.getuid() else None
    except OSError:
        return None


def _read_once_per_node(run_id: str, endpoint: tuple[str, int]) -> int | None:
    """The round, read from the rendezvous store by one worker of this start and by its siblings from its note.

    The state is one pickle of every node's entry (146 KB at 1,250 nodes): read by every rank, a job of 1,250
    nodes of 8 would pull 1.5 GB from the one agent that serves it at each start; read once per node, 183 MB,
    what one round of the agents' own heartbeats moves. Where the agent's directory is unknown (``--log-dir
    /dev/null``), each rank reads.
    """
    start = _start_directory()
    if start is None:
        return _rendezvous_round(run_id, endpoint)
    note = os.path.join(start, NOTE)
    fd = os.open(start, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the siblings wait for the first reader; released when fd closes
        except OSError:  # a log directory where flock is refused (some network filesystems): each rank reads
            return _rendezvous_round(run_id, endpoint)
        try:
            with open(note, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            try:
                found = _rendezvous_round(run_id, endpoint)
                text = f"round {'' if found is None else found}"
            except ConnectionError as e:
                text = f"error {e}"  # the siblings fail at once with it, not one timeout each
            with contextlib.suppress(OSError):  # without a note, each sibling reads for itself
                with open(note + ".part", "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(note + ".part", note)
    finally:
        os.close(fd)
    kind, _, value = text.partition(" ")
    if kind == "error":
        raise ConnectionError(value)
    return int(value) if value.isdigit() else None


def incarnation() -> str | None:
    """The name of this process's incarnation of a torchrun group, or None (not torchrun's agent store, or unknown).

    Raises:
        ConnectionError: a worker of a c10d rendezvous could not read its round (the agents' store is gone).

    Examples:
        >>> from ignite_ext.distributed.store.incarnation import incarnation
        >>> incarnation() is None  # not a worker of torchrun's agent
        True

    .. versionadded:: 0.5.0
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not run_id:
        return None
    args = _agent_arguments()
    endpoint = None if args is None else _rendezvous_endpoint(args)
    found = None if endpoint is None else _read_once_per_node(run_id, endpoint)
    if found is not None:
        return f"round-{found}"
    # One agent: its restart count is every rank's. Static rendezvous (torchrun's default with --node-rank): an
    # agent restarts only when its own workers fail (no membership changes), so each incarnation costs every
    # node one restart, and the counts agree.
    static = args is not None and not getattr(args, "standalone", False) and args.rdzv_backend == "static"
    if os.environ.get("GROUP_WORLD_SIZE") == "1" or static:
        return f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0').strip() or '0'}"
    return None


def scoped(store: Store) -> Store:
    """``store`` under its incarnation's prefix, or ``store`` itself where there is no incarnation to name.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.incarnation import scoped
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> scoped(server) is server  # outside torchrun, nothing to scope
        True

    .. versionadded:: 0.5.0
    """
    return _under(store, incarnation())


def _under(store: Store, name: str | None) -> Store:
    if name is None:
        return store
    ours = PrefixStore(incarnation_prefix(name), store)
    _SCOPED.add(ours)
    return ours


def is_scoped(store: Store) -> bool:
    """Whether ``store`` is, or stands on, a store :func:`scoped` put under an incarnation's prefix.

    Examples:
        >>> import datetime
        >>> import torch.distributed as dist
        >>> from ignite_ext.distributed.store.incarnation import is_scoped
        >>> server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
        >>> is_scoped(dist.PrefixStore("default_pg", server))
        False

    .. versionadded:: 0.5.0
    """
    seen: Any = store
    while seen is not None:
        if seen in _SCOPED:
            return True
        seen = getattr(seen, "underlying_store", None)
    return False


def install() -> None:
    """Put the store of every group torch forms by ``env://`` under its incarnation's prefix (idempotent).

    torch has no public way to wrap a rendezvous (``register_rendezvous_handler`` refuses a scheme it knows), so
    this replaces the ``env`` entry of its private table, keeping the handler it wraps; a test fails if torch
    renames the table.

    Examples:
        >>> from ignite_ext.distributed.store.incarnation import install
        >>> install(); install()  # once is enough, twice is harmless

    .. versionadded:: 0.5.0
    """
    handlers = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):
        return
    current = handlers.get("env")
    if current is None or getattr(current, "__wrapped__", None) is not None:
        return

    def env(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
        for store, rank, world_size in current(url, **kwargs):
            name = incarnation()
            # torch before 2.6 puts the agent store's client under its node's restart count (/worker/attempt_<n>),
            # which differs across agents: the incarnation's name, the same on every node, takes its place.
            torchs = getattr(store, "underlying_store", None) if name is not None else None
            yield _under(store if torchs is None else torchs, name), rank, world_size

    env.__wrapped__ = current  # type: ignore[attr-defined]
    handlers["env"] = env
