"""The code users copy from README.md and docs/ runs: each block is a program the suite runs, or a fragment of one.

The rules, for whoever writes a page:

* A whole program is a ``.. code-block:: python`` (in the README, a ```` ```python ```` fence) whose first line is a
  comment naming its file, ``# quickstart.py``. The test writes it into an empty folder and runs each console
  command of the same page that names it (``$ torchrun --standalone --nproc-per-node=2 train.py``), or ``python
  quickstart.py`` when none does.
* A command's expected output is the lines after it, up to the next ``$``: each must appear in the output (ranks
  print in any order), with ``...`` matching anything. A command that ends with ``# exits with N`` must exit with
  ``N``; others with 0.
* A fragment's first line is ``# From <file>.py``: a program block of the docs, or a script of the repository
  (``examples/cached_ddp_training.py``). Its code lines (blank lines, comments and ``...`` aside) occur in that file,
  stripped, in the same order, so a fragment cannot drift from the program the suite runs.
* Any other Python block is an error, and so is Python in a plain ``::`` literal block.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._world import _kill_tree, free_port

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.rst") if "_build" not in p.parts)]
#: Per command: a page's program is a short job on 1-2 gloo ranks (seconds); the margin is for a loaded machine.
RUN_TIMEOUT_S = 150.0

PROGRAM = re.compile(r"^# ([\w.-]+\.py)$")
FRAGMENT = re.compile(r"^# From (\S+\.py)\b")
EXITS = re.compile(r"\s+# exits with (\d+)$")
#: Commands that need a Slurm cluster: tests/slurm runs them, on a node it starts.
SLURM_COMMANDS = ("srun ", "sbatch ", "scancel ", "scontrol ")


@dataclass
class Block:
    """A code block of a page: its language, its text and where it starts."""

    page: Path
    line: int
    language: str
    text: str
    commands: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


def _markdown_blocks(page: Path) -> list[Block]:
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        match = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append(Block(page, start, match.group(1) or "text", _dedent(body)))
        i += 1
    return blocks


def _rst_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    for i, line in enumerate(lines):
        directive = re.match(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(\w*)", line)
        literal = re.match(r"^(\s*)(?!\.\.).*::\s*$", line)
        if not directive and not literal:
            continue
        indent = len((directive or literal).group(1))  # type: ignore[union-attr]
        j = i + 1
        while j < len(lines) and re.match(r"^\s+:[\w-]+:", lines[j]):  # the directive's options
            j += 1
        body: list[str] = []
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            body.append(lines[j])
            j += 1
        language = (directive.group(2) or "text") if directive else "literal"
        blocks.append(Block(page, i + 1, language, _dedent(body)))
    return blocks


def _dedent(body: list[str]) -> str:
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    margin = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
    return "\n".join(b[margin:] for b in body)


def _blocks(page: Path) -> list[Block]:
    return _markdown_blocks(page) if page.suffix == ".md" else _rst_blocks(page)


def _console_commands(block: Block) -> list[tuple[str, list[str]]]:
    """The ``$`` commands of a console block, each with the output lines shown after it."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:].strip(), []))
        elif commands and line.strip():
            commands[-1][1].append(line.rstrip())
    return commands


ALL_BLOCKS = [block for page in PAGES for block in _blocks(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language in ("python", "py", "python3")]
PROGRAMS = {m.group(1): b for b in PYTHON_BLOCKS if (m := PROGRAM.match(b.first_line))}
FRAGMENTS = [b for b in PYTHON_BLOCKS if FRAGMENT.match(b.first_line)]


def _looks_like_python(text: str) -> bool:
    return bool(re.search(r"^(?:import \w|from [\w.]+ import |def \w+\(|with idist\.)", text, re.M))


def test_every_python_block_is_a_program_or_a_fragment() -> None:
    stray = [
        f"{b.where}: {b.first_line!r}"
        for b in PYTHON_BLOCKS
        if not PROGRAM.match(b.first_line) and not FRAGMENT.match(b.first_line)
    ]
    stray += [f"{b.where}: Python in a '::' block" for b in ALL_BLOCKS if b.language == "literal" and
              _looks_like_python(b.text)]  # fmt: skip
    assert not stray, "blocks that are neither '# <name>.py' programs nor '# From <file>.py' fragments:\n" + "\n".join(
        stray
    )


def test_each_program_name_means_one_program() -> None:
    seen: dict[str, Block] = {}
    for block in PYTHON_BLOCKS:
        match = PROGRAM.match(block.first_line)
        if match:
            other = seen.setdefault(match.group(1), block)
            assert other.text == block.text, f"{match.group(1)}: different programs at {other.where}, {block.where}"


def _code_lines(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        code = re.split(r"\s+#\s", line.strip(), maxsplit=1)[0].strip()
        if code and not code.startswith("#") and code != "...":
            lines.append(code)
    return lines


@pytest.mark.parametrize("block", FRAGMENTS, ids=lambda b: b.where)
def test_each_fragment_occurs_in_its_program(block: Block) -> None:
    name = FRAGMENT.match(block.first_line).group(1)  # type: ignore[union-attr]
    if name in PROGRAMS:
        program = PROGRAMS[name].text
    else:
        assert (REPO / name).is_file(), f"{block.where}: {name} is neither a program block nor a file of the repository"
        program = (REPO / name).read_text()
    remaining = iter(_code_lines(program))
    missing = [line for line in _code_lines(block.text) if not any(line == other for other in remaining)]
    assert not missing, f"{block.where}: lines not found in {name}, in order: {missing}"


def _commands_for(name: str, program: Block) -> list[tuple[str, list[str]]]:
    commands = []
    for block in ALL_BLOCKS:
        if block.page == program.page and block.language in ("console", "shell-session"):
            commands += [
                c
                for c in _console_commands(block)
                if name in shlex.split(EXITS.split(c[0])[0]) and not c[0].startswith(SLURM_COMMANDS)
            ]
    return commands or [(f"python {name}", [])]


def _missing(expected: list[str], output: list[str]) -> list[str]:
    """The expected lines that no output line matches (``...`` matches anything)."""
    patterns = {line: ".*".join(re.escape(part) for part in line.strip().split("...")) for line in expected}
    return [line for line, pattern in patterns.items() if not any(re.fullmatch(pattern, o.strip()) for o in output)]


def _run(command: str, folder: Path) -> tuple[int, str]:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),  # never a port other worlds of the suite may hold
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        command,
        shell=True,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout kills the ranks and their workers too
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)  # torchrun's ranks are in sessions of their own: the whole tree goes
        out, _ = proc.communicate()
        pytest.fail(f"{command} ran past {RUN_TIMEOUT_S:.0f} s; output:\n{out[-4000:]}")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the job left behind
    return proc.returncode, out


@pytest.mark.distributed
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(PROGRAMS), ids=lambda n: f"{n}@{PROGRAMS[n].where}")
def test_each_program_runs_as_its_page_shows(name: str, tmp_path: Path) -> None:
    program = PROGRAMS[name]
    (tmp_path / name).write_text(program.text + "\n")
    for command, expected in _commands_for(name, program):
        exits = EXITS.search(command)
        rc, out = _run(EXITS.split(command)[0], tmp_path)
        want = int(exits.group(1)) if exits else 0
        assert rc == want, f"{program.where}: `{command}` exited with {rc}, not {want}; output:\n{out[-4000:]}"
        missing = _missing(expected, out.splitlines())
        assert not missing, f"{program.where}: `{command}` did not print {missing}; output:\n{out[-4000:]}"
