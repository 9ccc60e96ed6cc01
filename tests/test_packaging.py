"""A plain ``pip install .`` (no extras) in a fresh virtual environment gives a package whose every capability works,
and ``python -m build`` makes an sdist and a wheel that an index would take and that install there.

The environment gets ``torch==2.13.0`` first (as the README's commands install it), then the project from a copy of
its source without extras, so anything the code imports at run time but ``setup.py`` does not declare fails here.
"""

from __future__ import annotations

import ast
import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import ignite_ext

ROOT = Path(__file__).resolve().parents[1]

# Every capability once, in the fresh environment: scheduler, download + extraction, sampler, cache and its handler.
USE_EVERYTHING = r"""
import hashlib, io, sys, tarfile, tempfile
from pathlib import Path

import ignite_ext.data
assert "torch" not in sys.modules and "numpy" not in sys.modules, "the data face imported torch or numpy"

import numpy as np
import torch
from ignite.engine import Engine, Events

import ignite_ext.distributed as idist
from ignite_ext.data import CachedDataset, CacheStatsHandler, ShardedDistributedSampler, download_url
from ignite_ext.errors import IgniteExtError

with tempfile.TemporaryDirectory() as tmp:
    archive = Path(tmp, "src", "d.tar.gz")
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("d/x.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    with idist.one_rank_first() as first:
        out = download_url(archive.as_uri(), Path(tmp, "data"), sha256=digest, extract=True, progress=False)
    assert first and (out / "d" / "x.txt").read_bytes() == b"ok"
    with idist.rank_scheduler(order=idist.SharedPath(tmp)) as turn:
        assert turn.leader == 0

samples = [{"x": torch.full((4,), float(i)), "a": np.arange(3) + i} for i in range(8)]
dataset = CachedDataset(samples, capacity_bytes=1 << 20)
sampler = ShardedDistributedSampler(dataset, shuffle=True, seed=1)
engine = Engine(lambda engine, i: dataset[i])
CacheStatsHandler(dataset).attach(engine, name="cache")
engine.run(list(sampler), max_epochs=2)
assert engine.state.metrics["cache/hit_rate"] == 1.0, engine.state.metrics
assert dataset[3]["a"].tolist() == [3, 4, 5]
dataset.close()
assert issubclass(idist.RankFailedError, IgniteExtError)
print("every capability works")
"""


Run = Callable[..., subprocess.CompletedProcess[str]]


def _source_copy(tmp_path: Path) -> Path:
    """A copy of the checkout as a user's would be: no git data, environments, build outputs or docs."""
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv*", "docs", "__pycache__", "*.egg-info", "build", "dist"),
    )
    return source


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """A new virtual environment with ``torch==2.13.0`` alone; its python, and a runner that fails on an error."""
    where = tmp_path_factory.mktemp("fresh")
    env_dir = where / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if env.get("RES_OPTIONS") == "use-vc":  # the suite's resolver setting (conftest.py) fails every public name here
        del env["RES_OPTIONS"]

    def run(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
        command = [str(a) for a in args]
        done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    python = env_dir / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "torch==2.13.0", timeout=600)
    return python, run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plain_install_without_extras_uses_every_capability(tmp_path: Path, fresh_env: tuple[Path, Run]) -> None:
    python, run = fresh_env
    run(python, "-m", "pip", "uninstall", "-q", "-y", "ignite_ext", timeout=120)
    run(python, "-m", "pip", "install", "-q", _source_copy(tmp_path), timeout=600)
    where = run(python, "-c", "import ignite_ext; print(ignite_ext.__file__)", timeout=60).stdout
    assert Path(where.strip()).is_relative_to(python.parents[1]), f"imported from {where}, not the fresh environment"
    done = run(python, "-c", USE_EVERYTHING, timeout=300)
    assert done.stdout.strip().endswith("every capability works"), done.stdout


def _python_minors(classifiers: list[str]) -> set[str]:
    """The ``3.x`` versions that the classifiers name."""
    return {c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_sdist_and_the_wheel_pass_twine_check_and_the_wheel_installs(
    tmp_path: Path, fresh_env: tuple[Path, Run]
) -> None:
    python, run = fresh_env
    version, dist = ignite_ext.__version__, tmp_path / "dist"
    # An isolated build, as a user's: setuptools from the index, and the wheel built from the unpacked sdist.
    run(sys.executable, "-m", "build", "--outdir", dist, _source_copy(tmp_path), timeout=600)
    [wheel], [sdist] = dist.glob("*.whl"), dist.glob("*.tar.gz")
    assert (wheel.name, sdist.name) == (f"ignite_ext-{version}-py3-none-any.whl", f"ignite_ext-{version}.tar.gz")

    info = f"ignite_ext-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        shipped, metadata = set(archive.namelist()), email.message_from_bytes(archive.read(f"{info}/METADATA"))
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ignite_ext").rglob("*.py")}
    assert modules - shipped == set(), "modules missing from the wheel (a folder without __init__.py?)"
    assert {"ignite_ext/py.typed", f"{info}/licenses/LICENSE", f"{info}/entry_points.txt"} <= shipped
    assert {n.split("/")[0] for n in shipped} == {"ignite_ext", info}, "the wheel ships more than the package"

    top = f"ignite_ext-{version}"
    with tarfile.open(sdist) as archive:
        packed = {n.removeprefix(f"{top}/") for n in archive.getnames()}
    assert {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "setup.py", "ignite_ext/py.typed"} <= packed
    assert modules <= packed and not any(n.startswith("tests") for n in packed), sorted(packed)

    assert metadata["Version"] == version and metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text(encoding="utf-8").strip()
    classifiers = metadata.get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in classifiers and "Typing :: Typed" in classifiers
    assert any(c.startswith("Topic :: ") for c in classifiers), classifiers
    # The versions the classifiers name are exactly those Requires-Python admits.
    admitted = SpecifierSet(metadata["Requires-Python"])
    minors = _python_minors(classifiers)
    assert minors == {f"3.{m}" for m in range(8, 16) if f"3.{m}.0" in admitted}, (minors, admitted)

    run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, timeout=120)  # the README renders

    run(python, "-m", "pip", "uninstall", "-q", "-y", "ignite_ext", timeout=120)
    run(python, "-m", "pip", "install", "-q", wheel, timeout=600)
    check = "import ignite_ext, pathlib; print(ignite_ext.__version__, pathlib.Path(ignite_ext.__file__).parent)"
    installed, folder = run(python, "-c", check, timeout=60).stdout.split()
    assert (
        installed == version and Path(folder, "py.typed").is_file() and Path(folder).is_relative_to(python.parents[1])
    )
    run(python.parent / "ignite-ext", "--help", timeout=60)  # the console script


def _install_requires() -> list[Requirement]:
    """``setup.py``'s ``install_requires``, read from its source (running it would need a build backend)."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [Requirement(text) for text in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no install_requires")


def test_filelock_is_a_dependency_on_windows_only() -> None:
    # Elsewhere the download lock is the package's own fcntl record lock: filelock is not installed for it.
    [filelock] = [r for r in _install_requires() if r.name == "filelock"]
    assert filelock.marker is not None, str(filelock)
    assert filelock.marker.evaluate({"sys_platform": "win32"})
    assert not filelock.marker.evaluate({"sys_platform": "linux"})
    assert not filelock.marker.evaluate({"sys_platform": "darwin"})


# Downloads, extraction and their lock where filelock cannot be imported (not installed: Linux without the extra).
WITHOUT_FILELOCK = textwrap.dedent(
    """
    import hashlib, sys, tarfile, tempfile
    from pathlib import Path
    sys.modules["filelock"] = None  # import filelock raises ImportError
    from ignite_ext._locks import RecordLock
    from ignite_ext.data import download_url
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "a.txt")
        source.write_text("a")
        with tarfile.open(Path(tmp, "a.tar"), "w") as tar:
            tar.add(source, "a.txt")
        digest = hashlib.sha256(Path(tmp, "a.tar").read_bytes()).hexdigest()
        out = download_url(Path(tmp, "a.tar").as_uri(), Path(tmp, "data"), sha256=digest, extract=True)
        assert Path(out, "a.txt").read_text() == "a"
        lock = RecordLock(str(Path(tmp, ".x.lock")))
        assert lock.acquire() and not RecordLock(str(Path(tmp, ".x.lock"))).acquire(blocking=False)
        lock.release()
    print("works without filelock")
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="filelock is the lock there")
def test_downloads_work_where_filelock_is_not_installed() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WITHOUT_FILELOCK]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "works without filelock", done.stderr


def _release(version: str) -> tuple[int, ...]:
    """``"0.3.0"`` as ``(0, 3, 0)``; the package's versions are plain releases."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    return tuple(int(part) for part in version.split("."))


def test_the_changelog_describes_the_version_of_the_package() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = [line.removeprefix("## ").strip() for line in text.splitlines() if line.startswith("## ")]
    assert versions[0] == ignite_ext.__version__, (versions, ignite_ext.__version__)
    assert versions == sorted(versions, key=_release, reverse=True), versions


def test_no_name_is_newer_than_the_package() -> None:
    current = _release(ignite_ext.__version__)
    newer = []
    for path in sorted((ROOT / "ignite_ext").rglob("*.py")):
        for version in re.findall(r"versionadded:: (\d+\.\d+\.\d+)", path.read_text()):
            if _release(version) > current:
                newer.append(f"{path.relative_to(ROOT)}: {version}")
    assert newer == [], newer
