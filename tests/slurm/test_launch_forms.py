"""Every Slurm launch form, on a Slurm node the test starts: the launchers page's recipes, then the package beside
plain ignite.

* The page's Slurm section is the text of the first test: its ``train.py`` (the node cache, the sampler, the
  scheduler), its sbatch scripts and each of its ``$ srun``/``$ sbatch`` commands, run as written, with the output
  the page shows (``tests/test_docs_code.py`` leaves these commands here).
* The second runs ``tests/slurm/_body.py`` (a download once per node in ``one_rank_first(local=True)``, then a
  block where rank 0 raises) under ``srun -n 2``, under one torchrun per node and under two torchruns on one node,
  with ``ignite_ext.distributed`` and with plain ``ignite.distributed``.

Every command runs under ``timeout``; the fixture cancels what a test's jobs left.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests._slurm import SlurmBed
from tests._world import free_port
from tests.test_docs_code import ALL_BLOCKS, PROGRAMS, Block, _console_commands, _missing

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "launchers.rst"
#: A command's deadline: a 2-rank gloo job of the page takes 3-6 s here; the margin is for a loaded machine.
DEADLINE_S = 120
SCRIPT = re.compile(r"^# ([\w.-]+\.sbatch)$")


def _section_blocks() -> list[Block]:
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line == "Slurm" and lines[i + 1].startswith("---"))
    return [b for b in ALL_BLOCKS if b.page == PAGE and b.line > start]


def _scripts(blocks: list[Block]) -> dict[str, str]:
    """The page's sbatch scripts: bash blocks whose second line names the file."""
    found = {}
    for block in blocks:
        lines = block.text.splitlines()
        if block.language == "bash" and len(lines) > 1 and (match := SCRIPT.match(lines[1])):
            found[match.group(1)] = block.text + "\n"
    return found


def _run(slurm: SlurmBed, command: str, folder: Path, deadline: int = DEADLINE_S) -> tuple[int, str]:
    env = slurm.job_env(MASTER_PORT=str(free_port()))  # the page's torchrun endpoint: a port no other run holds
    done = subprocess.run(
        ["timeout", "-k", "5", str(deadline), "bash", "-c", command],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return done.returncode, done.stdout


def test_the_pages_slurm_recipes_run_as_shown(slurm: SlurmBed, tmp_path: Path) -> None:
    blocks = _section_blocks()
    commands = [c for b in blocks if b.language == "console" for c in _console_commands(b)]
    scripts = _scripts(blocks)
    assert len(commands) >= 4 and set(scripts) >= {"srun.sbatch", "torchrun.sbatch"}, (commands, sorted(scripts))
    (tmp_path / "train.py").write_text(PROGRAMS["train.py"].text + "\n")
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
    for command, expected in commands:
        with slurm.requeued_at_once():  # the requeue recipe's second run: Slurm would hold it for 2 minutes
            rc, out = _run(slurm, command, tmp_path)
        assert rc == 0, f"`{command}` exited with {rc}; output:\n{out[-4000:]}\n{slurm.logs()}"
        missing = _missing(expected, out.splitlines())
        assert not missing, f"`{command}` did not print {missing}; output:\n{out[-4000:]}"


#: The launch forms, each of two ranks on the one node: ``{port}`` is a free port for torchrun's rendezvous.
FORMS = {
    "srun": "srun -n 2 python -m tests.slurm._body {module} {folder}",
    "torchrun-per-node": (
        "srun --ntasks-per-node=1 torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d "
        "--rdzv-endpoint=127.0.0.1:{port} -m tests.slurm._body {module} {folder}"
    ),
    "two-torchruns-one-node": (
        "srun -n 2 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        "--rdzv-endpoint=127.0.0.1:{port} -m tests.slurm._body {module} {folder}"
    ),
}


def _launch(slurm: SlurmBed, form: str, module: str, folder: Path, deadline: int = DEADLINE_S) -> tuple[int, str]:
    folder.mkdir()
    command = FORMS[form].format(module=module, folder=folder, port=free_port())
    return _run(slurm, command, ROOT, deadline)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_launch_form_runs_the_package(slurm: SlurmBed, form: str, tmp_path: Path) -> None:
    rc, out = _launch(slurm, form, "ignite_ext.distributed", tmp_path / "data")
    assert rc == 1, f"{form}: exited with {rc}, not 1 (rank 0 raises); output:\n{out[-4000:]}"
    formed = sorted(re.findall(r"formed (\d) (\d)", out))
    assert formed == [("0", "2"), ("1", "2")], f"{form}: the group of 2 did not form; output:\n{out[-4000:]}"
    downloads = len((tmp_path / "data" / "downloads").read_text().split())
    # Two torchruns are two nodes to torchrun (--nnodes=2), and so to local=True: one download per torchrun at
    # most (the second finds the first's file when it comes later).
    assert downloads == 1 or (form == "two-torchruns-one-node" and downloads == 2), f"{downloads} downloads"
    assert len(re.findall(r"downloads \d", out)) == 2, out[-4000:]
    assert "rank 0 raised ValueError: rank 0 cannot read its shard" in out, out[-4000:]
    assert re.search(r"rank 1 raised RankFailedError: .*\[0\]", out), out[-4000:]


def test_plain_ignite_beside(slurm: SlurmBed, tmp_path: Path) -> None:
    # What ignite 0.5.5 alone gives under each form (docs/backends.rst quotes it): the group forms under srun and
    # under one torchrun per node; two torchruns on one node are refused. No rank learns which rank failed.
    # A refused torchrun leaves the other's ranks waiting for it (srun waits for every task): a short deadline.
    outputs = {form: _launch(slurm, form, "ignite.distributed", tmp_path / form, 30) for form in sorted(FORMS)}
    for form, (rc, out) in outputs.items():
        assert rc != 0 and "RankFailedError" not in out, f"{form}: rc {rc}; output:\n{out[-4000:]}"
    for form in ("srun", "torchrun-per-node"):
        out = outputs[form][1]
        assert "formed 0 2 0" in out and "downloads 1" in out, f"{form}: output:\n{out[-4000:]}"
    refused = outputs["two-torchruns-one-node"][1]
    assert "inconsistent with equivalent SLURM env variable" in refused, refused[-4000:]
    srun_out = outputs["srun"][1]
    # gloo says "closed" or "reset", by which end of the connection went first
    assert "rank 1 raised RuntimeError: " in srun_out, srun_out[-4000:]
    assert re.search(r"Connection (?:closed|reset) by peer", srun_out), srun_out[-4000:]
