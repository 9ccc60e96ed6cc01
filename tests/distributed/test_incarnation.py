"""The store of a torchrun group's incarnation: torch's env:// rendezvous, wrapped, puts it under its own prefix.

The real launcher's runs are in ``test_torchrun_restart.py``; here, the contract with torch (the private table the
package wraps) and what a worker's environment decides, in one process.
"""

from __future__ import annotations

import base64
import datetime
import io
import pickle
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import ignite_ext.distributed  # noqa: F401  (installs the wrapped rendezvous)
from ignite_ext.distributed.store import incarnation
from ignite_ext.distributed.store.clients import read
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
    assert read(server, "gloo-address") is None  # the attempt before's key of that name is never read


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


def _c10d_state(server: dist.TCPStore, run_id: str, round_: int) -> None:
    """What torch's c10d agents keep in their rendezvous store: the pickled state, base64, under one key."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round = round_
    server.set(f"torch.rendezvous.{run_id}", base64.b64encode(pickle.dumps(state)))


def _c10d_worker(monkeypatch: pytest.MonkeyPatch, port: int, start: Path, local_rank: int) -> None:
    """A worker of a c10d agent, as the agent starts it: its command line (read from /proc) and its error file."""
    _agents_worker(monkeypatch, "2")
    agent = incarnation.argparse.Namespace(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", standalone=False)
    monkeypatch.setattr(incarnation, "_agent_arguments", lambda: agent)
    (start / str(local_rank)).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(start / str(local_rank) / "error.json"))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_a_node_reads_the_rendezvous_round_once_per_start(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    start = tmp_path / "run" / "attempt_0"
    _c10d_state(server, "job", 4)
    _c10d_worker(monkeypatch, server.port, start, 0)
    assert incarnation.incarnation() == "round-4"
    server.delete_key("torch.rendezvous.job")  # what the siblings read is the first one's note, not the store
    for local_rank in (1, 2):
        _c10d_worker(monkeypatch, server.port, start, local_rank)
        assert incarnation.incarnation() == "round-4"
    # The agent's next start (a membership change keeps attempt_0): the directory is made anew, the store read.
    shutil.rmtree(start)
    _c10d_state(server, "job", 5)
    _c10d_worker(monkeypatch, server.port, start, 1)
    assert incarnation.incarnation() == "round-5"


def test_a_rendezvous_store_that_does_not_answer_fails_every_worker_of_the_node_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Falling back to no name would leave the rank out of its peers' group until the group's timeout.
    monkeypatch.setattr(incarnation, "READ_TIMEOUT", datetime.timedelta(seconds=2))
    start, port = tmp_path / "run" / "attempt_1", free_port()
    _c10d_worker(monkeypatch, port, start, 0)
    began = time.monotonic()
    with pytest.raises(ConnectionError, match=f"rendezvous round at 127.0.0.1:{port}"):
        incarnation.incarnation()
    _c10d_worker(monkeypatch, port, start, 1)
    sibling = time.monotonic()
    with pytest.raises(ConnectionError, match=f"rendezvous round at 127.0.0.1:{port}"):
        incarnation.incarnation()
    assert time.monotonic() - sibling < (sibling - began) / 2  # from the note, not a timeout of its own


def test_a_rendezvous_state_of_another_format_names_nothing(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A torch that changes its state's key or format: no rank names the incarnation, the store is torch's.
    _c10d_worker(monkeypatch, server.port, tmp_path / "run" / "attempt_0", 0)
    assert incarnation.incarnation() is None
    server.set("torch.rendezvous.job", b"not base64 pickle")
    _c10d_worker(monkeypatch, server.port, tmp_path / "run2" / "attempt_0", 0)
    assert incarnation.incarnation() is None
