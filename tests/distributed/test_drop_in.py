"""ignite_ext.distributed stands in for ignite.distributed: the arguments ignite's one_rank_first accepts, with the
same meaning, and the submodule paths."""

from __future__ import annotations

import importlib
from typing import Any

import ignite.distributed
import numpy as np
import pytest
import torch

import ignite_ext.distributed as idist


@pytest.mark.parametrize(
    ("rank", "local"),
    [(np.int64(0), 0), (torch.tensor(0), np.bool_(False)), (0, ""), (np.int32(0), 1), (0, torch.tensor(True))],
)
def test_one_rank_first_takes_what_ignites_takes(rank: Any, local: Any) -> None:
    with ignite.distributed.one_rank_first(rank, local):  # ignite's own accepts it
        pass
    with idist.one_rank_first(rank, local) as first:
        assert first
    assert repr(idist.MasterFirst(rank, local)) == f"MasterFirst(rank=0, local={bool(local)})"


@pytest.mark.parametrize("rank", [1, np.int64(-1), torch.tensor(3)])
def test_a_rank_out_of_range_is_ignites_value_error(rank: Any) -> None:
    with pytest.raises(ValueError, match="rank should be between 0 and 0"), ignite.distributed.one_rank_first(rank):
        pass
    with pytest.raises(ValueError, match="rank should be between 0 and 0"), idist.one_rank_first(rank):
        pass


@pytest.mark.parametrize("name", ["utils", "auto", "launcher", "comp_models", "comp_models.native"])
def test_the_submodule_paths_of_ignite_distributed_resolve(name: str) -> None:
    ours = importlib.import_module(f"ignite_ext.distributed.{name}")
    theirs = importlib.import_module(f"ignite.distributed.{name}")
    public = getattr(theirs, "__all__", None) or [n for n in dir(theirs) if not n.startswith("_")]
    assert public and all(hasattr(ours, n) for n in public)
    if name == "utils":
        assert ours.one_rank_first is idist.one_rank_first  # the failure-safe one
        assert ours.get_rank is theirs.get_rank
    else:
        assert ours is theirs


def body_mismatched_blocks() -> dict[str, Any]:
    try:
        if idist.get_rank() == 1:
            with idist.one_rank_first():  # one block more than the others: a rank must not pair it with theirs
                pass
        with idist.one_rank_first():
            pass
        return {"outcome": "ok"}
    except ValueError as exc:
        return {"outcome": "ValueError", "message": str(exc)}


def test_ranks_entering_different_blocks_raise_naming_the_call_sites(world: Any) -> None:
    seen = world(body_mismatched_blocks, nprocs=2, deadline=60)
    assert [s["outcome"] for s in seen] == ["ValueError"] * 2, seen
    message = seen[0]["message"]
    assert "entered different blocks" in message and message == seen[1]["message"]
    lines = {int(part.split(":")[1].split(";")[0].split(")")[0]) for part in message.split("at test_drop_in.py")[1:]}
    assert len(lines) == 2, message  # both call sites are named


class _Unstable(idist.Policy):
    """Plans by something each rank sees differently: its own rank."""

    def plan(self, world: Any, comm: Any) -> Any:
        first = idist.get_rank()  # every rank believes it goes first
        return idist.Plan(
            tuple(
                idist.Turn(r, r == first, frozenset() if r == first else frozenset({first}), tuple(range(2)), first)
                for r in range(world.world_size)
            )
        )


def body_unstable_plan() -> str:
    try:
        with idist.rank_scheduler(order=_Unstable()):
            return "ran"
    except ValueError as exc:
        return str(exc)


def test_a_custom_policy_that_plans_differently_on_different_ranks_is_refused_on_every_rank(world: Any) -> None:
    seen = world(body_unstable_plan, nprocs=2, deadline=60)
    assert all("planned differently on different ranks" in s for s in seen), seen


class _FailsOnRankOne(idist.Policy):
    def plan(self, world: Any, comm: Any) -> Any:
        if idist.get_rank() == 1:
            raise ValueError("no plan here")
        return idist.MasterFirst().plan(world, comm)


def body_failing_plan() -> str:
    try:
        with idist.rank_scheduler(order=_FailsOnRankOne()):
            return "ran"
    except ValueError as exc:
        return str(exc)


def test_a_custom_plan_raising_on_one_rank_raises_on_every_rank(world: Any) -> None:
    seen = world(body_failing_plan, nprocs=2, deadline=60)
    assert all("rank 1: ValueError: no plan here" in s for s in seen), seen
