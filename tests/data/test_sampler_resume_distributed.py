"""Elastic resume end to end: ignite Engine + Checkpoint on 4 gloo ranks, a rank SIGKILLed, resumed on 2 and 3.

Every rank appends what it trained on, one line per iteration, to a file of its own (``os.write`` on an
``O_APPEND`` descriptor: the lines survive the SIGKILL). Each iteration all-reduces like DDP's gradients, so the
ranks run in lockstep and a dead rank stops the others. What counts for the interrupted epoch is what the ranks
trained on up to the checkpoint that was loaded, plus what the resumed world trained on after it.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests._world import World

N = 100  # 25 per rank on 4 ranks, 34 on 3, 50 on 2
BATCH = 2  # per rank
SEED = 3
EVERY = 3  # a checkpoint every 3 iterations
DIE_AT = 8  # rank 3 of the first world kills itself in iteration 8: the last checkpoint is iteration 6
DEADLINE = 30.0  # per world; each takes about a second


def _train(run: str, resume_from: str | None, max_epochs: int, die_at: int | None, num_workers: int) -> dict[str, Any]:
    import torch
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver
    from torch.utils.data import DataLoader

    import ignite_ext.distributed as idist
    from ignite_ext.data import ShardedDistributedSampler
    from ignite_ext.data.sampler import SamplerHandler

    rank, world = idist.get_rank(), idist.get_world_size()
    sampler = ShardedDistributedSampler(range(N), seed=SEED)
    # fork: the ranks' own default start method is the harness's forkserver, which would start a server per rank
    context = "fork" if num_workers else None
    loader = DataLoader(
        range(N), batch_size=BATCH, sampler=sampler, num_workers=num_workers, multiprocessing_context=context
    )
    log = os.open(Path(run) / f"rank{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def step(engine: Engine, batch: torch.Tensor) -> None:
        if engine.state.iteration == die_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        idist.all_reduce(torch.ones(1))  # the lockstep of DDP's gradient all-reduce
        line = json.dumps({"epoch": engine.state.epoch, "iteration": engine.state.iteration, "batch": batch.tolist()})
        os.write(log, (line + "\n").encode())

    trainer = Engine(step)
    SamplerHandler(sampler, loader).attach(trainer)
    to_save = {"trainer": trainer, "sampler": sampler}
    saver = DiskSaver(Path(run) / "checkpoints", require_empty=False)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY), Checkpoint(to_save, saver, n_saved=None))
    if resume_from is not None:
        Checkpoint.load_objects(to_load=to_save, checkpoint=resume_from)
    started: dict[str, int] = {}

    @trainer.on(Events.STARTED)
    def _record(engine: Engine) -> None:  # after the handler's STARTED: the counts on this world
        started.update(iteration=engine.state.iteration, epoch_length=engine.state.epoch_length)

    trainer.run(loader, max_epochs=max_epochs)
    os.close(log)
    return {"rank": rank, "started": started, "iteration": trainer.state.iteration}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _lines(run: Path, world: int, up_to: int | None = None) -> list[list[dict[str, Any]]]:
    """Every rank's records, those after iteration ``up_to`` (work lost with the process) left out."""
    ranks = []
    for rank in range(world):
        records = [json.loads(line) for line in (run / f"rank{rank}.jsonl").read_text().splitlines()]
        ranks.append([r for r in records if up_to is None or r["iteration"] <= up_to])
    return ranks


def _samples(ranks: list[list[dict[str, Any]]], epoch: int) -> list[int]:
    return [i for records in ranks for r in records if r["epoch"] == epoch for i in r["batch"]]


def _checkpoint(run: Path, iteration: int) -> str:
    path = run / "checkpoints" / f"checkpoint_{iteration}.pt"
    assert path.exists(), sorted(p.name for p in (run / "checkpoints").iterdir())
    return str(path)


def _shards(n: int, world: int) -> list[set[int]]:
    from ignite_ext.data.sampler import shard_bounds

    return [set(range(*shard_bounds(n, world, r))) for r in range(world)]


@pytest.mark.distributed
def test_killed_at_4_ranks_resumed_at_2_and_at_3_sees_the_epoch_once(world: World, tmp_path: Path) -> None:
    from ignite_ext.data.sampler import Layout, Segment, restripe

    kw: dict[str, Any] = {"seed": SEED, "epoch": 0, "drop_last": False, "shuffle": True}
    first = tmp_path / "four"
    first.mkdir()
    results = world.results(_train, str(first), None, 2, DIE_AT, 0, nprocs=4, pg_timeout=20, deadline=DEADLINE)
    assert results[3].killed, results[3]
    assert not any(r.ok for r in results[:3])  # the survivors failed in the all-reduce instead of hanging
    saved = EVERY * ((DIE_AT - 1) // EVERY)  # 6: the last checkpoint before the death
    head = _lines(first, 4, up_to=saved)
    assert all(len(records) == saved for records in head)
    assert max(r["iteration"] for records in _lines(first, 4) for r in records) == DIE_AT - 1  # work lost: 7
    consumed = _samples(head, 1)
    assert len(consumed) == len(set(consumed)) == 4 * saved * BATCH  # 48 samples, 52 left

    # --- resumed on 2 ranks (no workers) and on 3 (a worker each: the DataLoader prefetches) -------------------
    for size, workers in ((2, 0), (3, 1)):
        run = tmp_path / f"resumed{size}"
        run.mkdir()
        out = world(_train, str(run), _checkpoint(first, saved), 2, None, workers, nprocs=size, deadline=DEADLINE)
        per_epoch = _ceil(_ceil(N, size), BATCH)  # 25 batches on 2 ranks, 17 on 3
        left = _ceil(N - len(consumed), size)  # each rank's share of the 52 left: 26, or 18 (padded)
        # the engine counts as if the run had always had this world: the epoch's batches done, then the rest
        assert all(
            o["started"] == {"iteration": per_epoch - _ceil(left, BATCH), "epoch_length": per_epoch} for o in out
        )
        assert all(o["iteration"] == 2 * per_epoch for o in out)
        tail = _lines(run, size)
        seen = Counter(consumed + _samples(tail, 1))
        assert set(seen) == set(range(N))  # every sample of the epoch...
        assert sum(c - 1 for c in seen.values()) == size * left - (N - len(consumed))  # ...once, but the padding
        # the same multiset as the pure maths
        expected = consumed + [
            i for r in range(size) for i in restripe(N, [Segment(Layout(4), 12)], Layout(size), r, **kw)
        ]
        assert seen == Counter(expected)
        # the next epoch: the new world's fixed shards, whole
        assert [set(_samples([records], 2)) for records in tail] == _shards(N, size)
        assert all(len(_samples([records], 2)) == _ceil(N, size) for records in tail)

    # --- 4 -> 3 -> 2: the 3-rank world's checkpoint at its 2nd resumed iteration loaded on 2 ranks ---------------
    three = tmp_path / "resumed3"
    at = 12  # the 3-rank world resumed at iteration 8 (17 - 9 batches): 4 of its batches done
    taken = consumed + _samples(_lines(three, 3, up_to=at), 1)
    run = tmp_path / "resumed2again"
    run.mkdir()
    world(_train, str(run), _checkpoint(three, at), 2, None, 0, nprocs=2, deadline=DEADLINE)
    tail = _lines(run, 2)
    seen = Counter(taken + _samples(tail, 1))
    assert set(seen) == set(range(N))
    assert sum(c - 1 for c in seen.values()) <= (3 - 1) + (2 - 1)  # padding of the two worlds at most
    segments = [Segment(Layout(4), 12), Segment(Layout(3), 4 * BATCH)]
    assert seen == Counter(
        consumed
        + [i for r in range(3) for i in restripe(N, segments[:1], Layout(3), r, **kw)[: 4 * BATCH]]
        + [i for r in range(2) for i in restripe(N, segments, Layout(2), r, **kw)]
    )
    assert [set(_samples([records], 2)) for records in tail] == _shards(N, 2)


def _load_mismatched(case: str) -> str:
    import ignite_ext.distributed as idist
    from ignite_ext.data import ShardedDistributedSampler

    rank = idist.get_rank()
    state = ShardedDistributedSampler(range(N), num_replicas=4, rank=0, seed=SEED).state_dict(consumed=5)
    n = N - 1 if case == "length" and rank == 1 else N
    if case == "state" and rank == 1:
        state = {**state, "consumed": 6}
    sampler = ShardedDistributedSampler(range(n), seed=SEED)
    try:
        sampler.load_state_dict(state)
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["length", "state"])
def test_a_mismatch_on_one_rank_is_an_error_on_every_rank(world: World, case: str) -> None:
    messages = world(_load_mismatched, case, nprocs=2, deadline=DEADLINE)
    assert messages[0] == messages[1] != "loaded"  # the same error, not a hang and not one rank only
    assert "loading the ShardedDistributedSampler state" in messages[0]
    assert ("dataset_len=100, this sampler has dataset_len=99" if case == "length" else "different states") in messages[
        0
    ]
