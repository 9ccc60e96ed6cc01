"""Every ``IGNITE_EXT_*`` environment variable the package reads, in one registry.

Each :class:`Setting` holds a variable's name, default, unit, accepted values and what it changes. It also says
who should set it: users (:data:`USER`), or only test beds and the package itself (:data:`INTERNAL`). The package
reads these variables through this module alone, when it uses them. The docs' settings page is this registry,
drawn as a table when the docs are built.

Standard library only: the download helpers and the progress board read their settings without importing torch.

Examples:
    >>> from ignite_ext import settings
    >>> settings.get("IGNITE_EXT_HEARTBEAT_TIMEOUT", environ={})
    10.0
    >>> settings.get("IGNITE_EXT_STORE_PORT", environ={"IGNITE_EXT_STORE_PORT": "eight"})
    Traceback (most recent call last):
    ...
    ValueError: IGNITE_EXT_STORE_PORT='eight': expected a port number (0: any free port)

.. versionadded:: 0.6.0
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "DOWNLOAD_BACKOFF_S",
    "EARLY_HEARTBEAT",
    "HEARTBEAT_TIMEOUT",
    "INTERNAL",
    "PERSIST_BYTES",
    "PROCESS_WATCH",
    "PROGRESS_BOARD",
    "REGISTRY",
    "RELAY",
    "RELAY_ADDR",
    "RELAY_PORTS",
    "SCHEDULER_CHANNEL",
    "STALL_TIMEOUT",
    "STORE_ADDR",
    "STORE_CONNECT_TIMEOUT",
    "STORE_PORT",
    "STORE_WATCHDOG",
    "USER",
    "WAITING_LINE",
    "WAIT_LOG_INTERVAL",
    "Setting",
    "get",
]

T = TypeVar("T")

#: A setting users may set.
USER = "user"
#: A setting for test beds and measurements, or one the package sets for its own child processes.
INTERNAL = "internal"


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable the package reads, and how it reads it.

    Args:
        name: the variable, ``IGNITE_EXT_...``.
        default: the value when the variable is unset.
        unit: what the value counts or names (``seconds``, ``bytes``, ``on/off``...).
        changes: what it changes, one short sentence (reStructuredText: the docs show it).
        audience: :data:`USER` or :data:`INTERNAL`.
        accepts: the values it takes, as the error and the docs say it.
        parse: the value from the variable's text; raises ``ValueError`` on text it does not take.
        default_text: the default as the docs show it, where ``default`` does not say it (computed, or absent).
        lenient: text that does not parse counts as unset (the variable's behaviour since it was added).

    Examples:
        >>> from ignite_ext.settings import HEARTBEAT_TIMEOUT, RELAY_PORTS
        >>> HEARTBEAT_TIMEOUT.read({"IGNITE_EXT_HEARTBEAT_TIMEOUT": "3"})
        3.0
        >>> HEARTBEAT_TIMEOUT.read({"IGNITE_EXT_HEARTBEAT_TIMEOUT": "3s"})  # lenient: the default
        10.0
        >>> RELAY_PORTS.read({"IGNITE_EXT_RELAY_PORTS": "45000-45099"})
        range(45000, 45100)
        >>> RELAY_PORTS.shown_default()
        'any free port'

    .. versionadded:: 0.6.0
    """

    name: str
    default: T
    unit: str
    changes: str
    audience: str
    accepts: str
    parse: Callable[[str], T]
    default_text: str = ""
    lenient: bool = False

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (``os.environ`` by default); ``ValueError`` naming the text if it does not parse.

        .. versionadded:: 0.6.0
        """
        text = (os.environ if environ is None else environ).get(self.name)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            if self.lenient:
                return self.default
            raise ValueError(f"{self.name}={text!r}: expected {self.accepts}") from None

    def shown_default(self) -> str:
        """The default as the docs show it.

        .. versionadded:: 0.6.0
        """
        if self.default_text:
            return self.default_text
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


_registry: dict[str, Setting[Any]] = {}
#: Every setting by name, users' first, in the order the docs list them.
#:
#: :meta hide-value:
REGISTRY: Mapping[str, Setting[Any]] = types.MappingProxyType(_registry)


def _register(setting: Setting[T]) -> Setting[T]:
    assert setting.name.startswith("IGNITE_EXT_") and setting.name not in _registry, setting.name
    _registry[setting.name] = setting
    return setting


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the setting ``name`` in ``environ`` (``os.environ`` by default).

    Raises:
        KeyError: ``name`` is not a setting of the package.
        ValueError: its text does not parse; the message names the variable, its text and what it accepts.

    Examples:
        >>> from ignite_ext import settings
        >>> settings.get("IGNITE_EXT_RELAY", environ={"IGNITE_EXT_RELAY": "0"})
        False

    .. versionadded:: 0.6.0
    """
    try:
        setting = _registry[name]
    except KeyError:
        raise KeyError(f"{name} is not a setting of ignite_ext (see ignite_ext.settings.REGISTRY)") from None
    return setting.read(environ)


def _on(text: str) -> bool:
    return text != "0"


def _text(text: str) -> str | None:
    return text or None


def _stripped(text: str) -> str | None:
    return text.strip() or None


def _optional_int(text: str) -> int | None:
    return int(text) if text else None


def _waiting_line(text: str) -> bool:
    return text.strip().lower() not in ("0", "off", "no", "false")


def _channel(text: str) -> str:
    return "collective" if text.lower() == "collective" else "auto"


def _ports(text: str) -> range:
    text = text.strip()
    if not text:
        return range(0, 1)
    first, _, last = text.partition("-")
    ports = range(int(first), int(last or first) + 1)
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ValueError(text)
    return ports


_SECONDS = "a number of seconds (other text: the default)"
_SWITCH = "0 for off; anything else: on"

# Users' settings: scheduling and failure detection.
HEARTBEAT_TIMEOUT = _register(
    Setting(
        name="IGNITE_EXT_HEARTBEAT_TIMEOUT", default=10.0, unit="seconds", audience=USER, lenient=True,
        changes="A rank that sends no heartbeat for this long is declared dead.",
        accepts=_SECONDS, parse=float,
    )
)  # fmt: skip
STALL_TIMEOUT = _register(
    Setting(
        name="IGNITE_EXT_STALL_TIMEOUT", default=600.0, unit="seconds", audience=USER, lenient=True,
        changes="The default ``stall_timeout``: a :term:`first rank` whose progress stops this long fails the block.",
        accepts="a number of seconds, ``inf`` for none (other text: the default)", parse=float,
    )
)  # fmt: skip
WAIT_LOG_INTERVAL = _register(
    Setting(
        name="IGNITE_EXT_WAIT_LOG_INTERVAL", default=30.0, unit="seconds", audience=USER, lenient=True,
        changes="A waiting rank logs whom it waits for this often.",
        accepts=_SECONDS, parse=float,
    )
)  # fmt: skip
WAITING_LINE = _register(
    Setting(
        name="IGNITE_EXT_WAITING_LINE", default=True, unit="on/off", audience=USER,
        changes="On a terminal, the waiting ranks of a node share one line, rewritten in place.",
        accepts="0, off, no or false for off; anything else: auto", parse=_waiting_line,
        default_text="auto (on a terminal)",
    )
)  # fmt: skip
STORE_WATCHDOG = _register(
    Setting(
        name="IGNITE_EXT_STORE_WATCHDOG", default=True, unit="on/off", audience=USER,
        changes="A :term:`store` that stops answering raises ``StoreLostError``; off, its requests wait for TCP.",
        accepts=_SWITCH, parse=_on,
    )
)  # fmt: skip
# Users' settings: the store rank 0 hosts under Horovod and XLA.
STORE_ADDR: Setting[str | None] = _register(
    Setting(
        name="IGNITE_EXT_STORE_ADDR", default=None, unit="host", audience=USER,
        changes="Horovod and XLA: the address other ranks use to reach rank 0's store.",
        accepts="a host name or address", parse=_stripped,
        default_text="``HOROVOD_HOSTNAME``, else rank 0's host name",
    )
)  # fmt: skip
STORE_PORT = _register(
    Setting(
        name="IGNITE_EXT_STORE_PORT", default=0, unit="port", audience=USER,
        changes="Horovod and XLA: the port of the store rank 0 starts.",
        accepts="a port number (0: any free port)", parse=int,
        default_text="0 (any free port)",
    )
)  # fmt: skip
STORE_CONNECT_TIMEOUT = _register(
    Setting(
        name="IGNITE_EXT_STORE_CONNECT_TIMEOUT", default=30.0, unit="seconds", audience=USER, lenient=True,
        changes="Horovod and XLA: how long a rank tries to reach rank 0's store.",
        accepts=_SECONDS, parse=float,
    )
)  # fmt: skip
# Users' settings: downloads and the cache.
RELAY = _register(
    Setting(
        name="IGNITE_EXT_RELAY", default=True, unit="on/off", audience=USER,
        changes="Lets ``download_url(relay=True)`` pass a file between ranks; off, each fetches the :term:`origin`.",
        accepts=_SWITCH, parse=_on,
    )
)  # fmt: skip
RELAY_ADDR: Setting[str | None] = _register(
    Setting(
        name="IGNITE_EXT_RELAY_ADDR", default=None, unit="address", audience=USER,
        changes="The address a rank's download :term:`relay` listens on.",
        accepts="an address of this host", parse=_text,
        default_text="this host's address toward ``MASTER_ADDR``",
    )
)  # fmt: skip
RELAY_PORTS = _register(
    Setting(
        name="IGNITE_EXT_RELAY_PORTS", default=range(0, 1), unit="ports", audience=USER,
        changes="The ports a download relay may listen on, for a firewall.",
        accepts="a port or a range 'first-last' of 1-65535", parse=_ports,
        default_text="any free port",
    )
)  # fmt: skip
DOWNLOAD_BACKOFF_S = _register(
    Setting(
        name="IGNITE_EXT_DOWNLOAD_BACKOFF_S", default=1.0, unit="seconds", audience=USER,
        changes="The first delay before a download retries; it doubles at each attempt.",
        accepts="a number of seconds", parse=float,
    )
)  # fmt: skip
PERSIST_BYTES: Setting[int | None] = _register(
    Setting(
        name="IGNITE_EXT_PERSIST_BYTES", default=None, unit="bytes", audience=USER,
        changes="The disk space your :term:`persisted caches <persisted cache>` in one ``disk_dir`` may take together.",
        accepts="a whole number of bytes", parse=_optional_int,
        default_text="half the filesystem",
    )
)  # fmt: skip
# Internal: switches of the test beds and benchmarks, and the package's hand-off to its child processes.
SCHEDULER_CHANNEL = _register(
    Setting(
        name="IGNITE_EXT_SCHEDULER_CHANNEL", default="auto", unit="name", audience=INTERNAL,
        changes="``collective``: ranks wait in the backend's collectives, not through a store.",
        accepts="collective; anything else: the default", parse=_channel,
        default_text="the store",
    )
)  # fmt: skip
EARLY_HEARTBEAT = _register(
    Setting(
        name="IGNITE_EXT_EARLY_HEARTBEAT", default=True, unit="on/off", audience=INTERNAL,
        changes="Ranks send heartbeats from the process group's start; off, from their first :term:`scheduled block`.",
        accepts=_SWITCH, parse=_on,
    )
)  # fmt: skip
PROCESS_WATCH = _register(
    Setting(
        name="IGNITE_EXT_PROCESS_WATCH", default=True, unit="on/off", audience=INTERNAL,
        changes="A :term:`keeper` process beside each rank reports its death at once; off, only silence tells.",
        accepts=_SWITCH, parse=_on,
    )
)  # fmt: skip
PROGRESS_BOARD: Setting[str | None] = _register(
    Setting(
        name="IGNITE_EXT_PROGRESS_BOARD", default=None, unit="pid:fd", audience=INTERNAL,
        changes="Set by each rank: where the DataLoader workers it spawns write their progress.",
        accepts="<pid>:<fd>", parse=_text,
        default_text="unset",
    )
)  # fmt: skip
