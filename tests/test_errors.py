"""One error root: every error of the package derives from IgniteExtError, keeps its stdlib base, and every error a
docstring says is raised can be imported from a public module; the exception classes outside errors.py are private
and either internal signals the package catches or refinements users meet as a public error
(docs/architecture.rst, "Errors")."""

from __future__ import annotations

import ast
import builtins
import importlib
import pickle
import pkgutil
import re
import urllib.error
from pathlib import Path

import pytest

import ignite_ext
import ignite_ext.data
import ignite_ext.distributed as idist
from ignite_ext import errors
from ignite_ext.errors import (
    ArchiveError,
    ChecksumError,
    DownloadError,
    IgniteExtError,
    RankDiedError,
    RankFailedError,
    RankFailure,
    ShmSpaceError,
    StoreLostError,
)

PACKAGE = Path(ignite_ext.__file__).parent
# Raised and caught inside the package (a retry, a fallback to the origin, a refused relay); a user never meets one.
INTERNAL = {
    "ignite_ext.data.download._http.FatalHTTPError",
    "ignite_ext.data.download._http.LengthConflict",
    "ignite_ext.data.download._http.RangeMismatch",
    "ignite_ext.data.download._http.RetryableError",
    "ignite_ext.data.download._http.TooSlow",
    "ignite_ext.data.download._relay_client.RelayGone",
    "ignite_ext.data.download._relay_client.RelayUnreachable",
    "ignite_ext.data.download._relay_wire.RelayRefused",
    "ignite_ext.data.download._urls.RedirectRefused",
}
# What the package itself tells apart among errors users meet, and catch, as the public class given.
REFINEMENTS = {
    "ignite_ext._locks.LockWaitExpired": DownloadError,
    "ignite_ext.data.download._job.DeadlinePassed": DownloadError,
    "ignite_ext.data.download._job.NoSpace": DownloadError,
}


def _modules() -> list[object]:
    names = [m.name for m in pkgutil.walk_packages(ignite_ext.__path__, "ignite_ext.")]
    return [importlib.import_module(n) for n in sorted(names) if not n.endswith("__main__")]


def test_every_exception_class_of_the_package_derives_from_the_root() -> None:
    found = set()
    for module in _modules():
        for value in vars(module).values():
            exception = isinstance(value, type) and issubclass(value, BaseException)
            if exception and value.__module__.startswith("ignite_ext"):
                found.add(value)
    assert {ArchiveError, ChecksumError, DownloadError, RankDiedError, StoreLostError, ShmSpaceError} <= found
    assert [cls.__qualname__ for cls in found if not issubclass(cls, IgniteExtError)] == []


def _module_name(path: Path) -> str:
    return ".".join(("ignite_ext", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _is_private(module: str) -> bool:
    return any(part.startswith("_") and part != "__init__" for part in module.split(".")[1:])


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class (warnings aside) defined in the package's source, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        nested = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name not in top]
        # A class made inside a function is found by no import: there should be none that is an exception.
        assert not [n for n in nested if re.search(r"Error|Exception|Refused|Gone|Expired", n)], (name, nested)
        if not top or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls_name in top:
            value = getattr(module, cls_name)
            if issubclass(value, BaseException) and not issubclass(value, Warning):
                found[f"{name}.{cls_name}"] = value
    return found


def test_exception_classes_outside_errors_py_are_private_and_either_internal_or_refinements() -> None:
    found = _exception_classes()
    outside = {name for name in found if not name.startswith("ignite_ext.errors.")}
    # A new exception class outside errors.py must be classified here (and in docs/architecture.rst's rule).
    assert outside == INTERNAL | set(REFINEMENTS), sorted(outside ^ (INTERNAL | set(REFINEMENTS)))
    assert [name for name in outside if not _is_private(name.rsplit(".", 1)[0])] == []
    public_errors = {getattr(errors, n) for n in errors.__all__} - {IgniteExtError}
    for name in INTERNAL:  # no user-facing error's except clause catches a signal by accident
        assert issubclass(found[name], IgniteExtError) and not set(found[name].__mro__) & public_errors, name
    for name, base in REFINEMENTS.items():
        assert base.__module__ == "ignite_ext.errors" and issubclass(found[name], base), name


def test_no_public_module_exports_a_private_exception_class() -> None:
    exported = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if _is_private(name) or name.endswith("__main__") or name == "ignite_ext.errors":
            continue
        module = importlib.import_module(name)
        for each in getattr(module, "__all__", ()):
            value = getattr(module, each)
            error = isinstance(value, type) and issubclass(value, BaseException) and not issubclass(value, Warning)
            if error and value.__module__ != "ignite_ext.errors":
                exported.append(f"{name}.{each}")
    assert exported == []


def _caught_names() -> set[str]:
    """The names in every ``except`` clause of the package."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                for part in ast.walk(node.type):
                    if isinstance(part, ast.Name):
                        names.add(part.id)
                    elif isinstance(part, ast.Attribute):
                        names.add(part.attr)
    return names


def test_every_internal_signal_is_caught_inside_the_package() -> None:
    # By its own name or a private base's: what the package raises to itself, it handles.
    caught = _caught_names()
    found = _exception_classes()
    for name in INTERNAL:
        own = [c.__name__ for c in found[name].__mro__ if c.__module__.startswith("ignite_ext.data")]
        assert set(own) & caught, f"{name}: no except clause of the package names it or {own[1:]}"


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (DownloadError, OSError),
        (DownloadError, urllib.error.URLError),  # what torchvision's download_url raises, and its datasets catch
        (ChecksumError, OSError),
        (ChecksumError, RuntimeError),  # what torchvision raises for a wrong md5
        (ArchiveError, ValueError),
        (RankFailedError, RuntimeError),
        (RankDiedError, RuntimeError),
        (StoreLostError, RuntimeError),
        (ShmSpaceError, RuntimeError),
    ],
)
def test_errors_keep_their_standard_library_base(cls: type[Exception], base: type[Exception]) -> None:
    assert issubclass(cls, IgniteExtError) and issubclass(cls, base)


def test_old_import_paths_give_the_same_classes() -> None:
    from ignite_ext.data.cache import ShmSpaceError as from_cache
    from ignite_ext.data.download import ArchiveError as from_download
    from ignite_ext.data.extract import ArchiveError as from_extract
    from ignite_ext.distributed.errors import RankFailedError as from_distributed

    assert from_cache is ShmSpaceError and from_download is from_extract is ArchiveError
    assert from_distributed is idist.RankFailedError is RankFailedError
    assert ignite_ext.data.DownloadError is DownloadError and ignite_ext.data.ShmSpaceError is ShmSpaceError


def _docstrings() -> list[tuple[str, str]]:
    found = []
    for module in _modules():
        found.append((module.__name__, module.__doc__ or ""))  # type: ignore[attr-defined]
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:  # type: ignore[attr-defined]
                continue
            found.append((f"{module.__name__}.{name}", getattr(value, "__doc__", None) or ""))  # type: ignore[attr-defined]
            if isinstance(value, type):
                for attr, member in vars(value).items():
                    doc = getattr(member, "__doc__", None) if callable(member) or isinstance(member, property) else None
                    found.append((f"{module.__name__}.{name}.{attr}", doc or ""))  # type: ignore[attr-defined]
    return found


def raised_names(doc: str) -> list[str]:
    """The exception names listed in the ``Raises:`` sections of a Google-style docstring."""
    names = []
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Raises:":
            continue
        indent = len(line) - len(line.lstrip())
        for item in lines[i + 1 :]:
            if item.strip() and len(item) - len(item.lstrip()) <= indent:
                break
            match = re.match(rf"^\s{{{indent + 4}}}(\w+):", item)
            if match:
                names.append(match.group(1))
    return names


def test_raises_sections_are_parsed() -> None:
    assert raised_names(ignite_ext.data.download_url.__doc__ or "") == [
        "ValueError",
        "ChecksumError",
        "DownloadError",
        "ArchiveError",
    ]


def test_every_error_named_in_a_raises_section_is_importable_from_a_public_module() -> None:
    # Private modules (a segment starting with "_") may name their own internal signals, which never escape.
    public = set(errors.__all__) | {n for n in dir(builtins) if n.endswith(("Error", "Exception"))}
    documented = [(where, doc) for where, doc in _docstrings() if not re.search(r"\._[a-z]", where.rsplit(".", 1)[0])]
    missing = [f"{where}: {name}" for where, doc in documented for name in raised_names(doc) if name not in public]
    assert missing == []


def test_a_dead_rank_is_typed_not_a_string() -> None:
    dead = RankFailure(3, RankDiedError.__name__, "no heartbeat for 30 s", died=True)
    err = RankFailedError([RankFailure(1, "OSError", "disk full"), dead], "waiting")
    assert err.ranks == (1, 3) and err.dead == (3,)
    assert "rank 3 died: no heartbeat" in str(err)


def test_a_lost_store_names_no_rank() -> None:
    err = StoreLostError("DistNetworkError: Connection reset by peer", "rank 2 waiting for rank 0")
    assert isinstance(err, RankFailedError) and err.ranks == () and err.failures == ()
    assert "rendezvous store" in str(err) and "-1" not in str(err)


@pytest.mark.parametrize(
    "err",
    [
        RankFailedError([RankFailure(0, "OSError", "x")], "ctx"),
        RankDiedError([RankFailure(1, "RankDiedError", "y", died=True)], "ctx"),
        StoreLostError("gone", "ctx"),
        DownloadError("u: HTTP 404", url="u", status=404),
        ChecksumError("u: md5 mismatch: expected ab, got cd", algorithm="md5", expected="ab", actual="cd", url="u"),
        ArchiveError("bad"),
        ShmSpaceError("full"),
    ],
)
def test_errors_cross_process_boundaries(err: Exception) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)


def test_download_errors_say_their_message_alone_and_keep_their_fields_across_processes() -> None:
    # URLError's own str() is "<urlopen error ...>": the package's errors keep the message as it was.
    err = ChecksumError("u: md5 mismatch: expected ab, got cd", algorithm="md5", expected="ab", actual="cd", url="u")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "u: md5 mismatch: expected ab, got cd" == back.reason
    assert (back.algorithm, back.expected, back.actual, back.url) == ("md5", "ab", "cd", "u")
    refused = pickle.loads(pickle.dumps(DownloadError("u: HTTP 404 Not Found", url="u", status=404)))
    assert str(refused) == "u: HTTP 404 Not Found" and (refused.url, refused.status) == ("u", 404)
