"""The store of a torchrun group's incarnation: torch's env:// rendezvous, wrapped, puts it under its own prefix.

The real launcher's runs are in ``test_torchrun_restart.py``; here, the contract with torch (the private table the
package wraps) and what a worker's environment decides, in one process.
"""

from __future__ import annotations

import datetime
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import ignite_ext.distributed  # noqa: F401  (installs the wrapped rendezvous)
from ignite_ext.distributed.store import incarnation
from ignite_ext.distributed.store.keys import incarnation_prefix
from tests._world import free_port


@pytest.fixture()
def server(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
                        "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return store


def _agents_worker(monkeypatch: pytest.MonkeyPatch, agents: str, restart: str = "0") -> None:
    """This process's environment as torchrun's agent sets it for its workers (no c10d rendezvous to read)."""
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job",
                        "GROUP_WORLD_SIZE": agents, "TORCHELASTIC_RESTART_COUNT": restart}.items():  # fmt: skip
        monkeypatch.setenv(name, value)


def _env_store() -> dist.Store:
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=10)))
    return store


def test_torch_still_has_the_rendezvous_table_the_package_wraps() -> None:
    table = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    assert getattr(table["env"], "__wrapped__", None) is not None  # installed at import, once
    incarnation.install()
    assert getattr(table["env"].__wrapped__, "__wrapped__", None) is None


def test_a_worker_of_one_agent_forms_on_its_restarts_own_store(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _agents_worker(monkeypatch, "1", restart="3")
    store = _env_store()
    assert incarnation.is_scoped(store) and incarnation.incarnation() == "restart-3"
    store.set("gloo-address", "restart 3's")
    assert server.get(f"{incarnation_prefix('restart-3')}/gloo-address") == b"restart 3's"
    assert not server.check(["gloo-address"])  # the attempt before's key of that name is never read


def test_several_agents_without_a_c10d_rendezvous_leave_the_store_as_torch_made_it(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their restart counts may differ (an agent whose workers were healthy does not count its restart): no name.
    _agents_worker(monkeypatch, "2")
    assert incarnation.incarnation() is None and not incarnation.is_scoped(_env_store())


def test_outside_torchrun_nothing_is_scoped(server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # rank 0 serves its own store
    assert incarnation.incarnation() is None and not incarnation.is_scoped(_env_store())


class _Planted:
    """What a neighbour who reaches the rendezvous port could write as its state: a pickle that runs code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "ran"))  # type: ignore[return-value]


def test_the_rendezvous_state_is_read_as_the_agents_state_and_nothing_else(tmp_path: Path) -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round = 4
    assert incarnation._StateUnpickler(io.BytesIO(pickle.dumps(state))).load().round == 4
    with pytest.raises(pickle.UnpicklingError, match="not a rendezvous state"):
        incarnation._StateUnpickler(io.BytesIO(pickle.dumps(_Planted(str(tmp_path / "ran"))))).load()
    assert not (tmp_path / "ran").exists()
