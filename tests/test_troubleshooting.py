"""The troubleshooting page has an entry for every public error and warning; the glossary defines the words used.

The classes are found, not listed: every package of ``ignite_ext`` (and :mod:`ignite_ext.errors`) is imported and
its ``__all__`` walked. A new public error or warning fails this test until the page says what it means.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import pkgutil
import re
from pathlib import Path

import pytest

import ignite_ext

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "troubleshooting.rst"
GLOSSARY = DOCS / "glossary.rst"
#: The package's own words for its parts: wherever the docs or a message use one, the glossary must define it.
INTERNAL_TERMS = (
    "arena",
    "census",
    "chain",
    "collective channel",
    "cut",
    "declared dead",
    "disk tier",
    "fingerprint",
    "heartbeat",
    "holder",
    "incarnation",
    "keeper",
    "leader",
    "node cache",
    "origin",
    "persisted cache",
    "RAM tier",
    "relay",
    "ring successor",
    "slice",
    "store channel",
    "tier",
    "verdict",
    "waiting line",
)
NODE_AXIS = (
    "one_rank_first(local=True)",
    'CachedDataset(scope="node")',
    'ShardedDistributedSampler(shard_by="node")',
    'reduce="node"',
)


def _public_faces() -> list[str]:
    """The modules users import names from: the package, each of its public subpackages, and its errors."""
    faces = ["ignite_ext", "ignite_ext.errors"]
    for info in pkgutil.walk_packages(ignite_ext.__path__, "ignite_ext."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            faces.append(info.name)
    return faces


def _public_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for face in _public_faces():
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__.startswith("ignite_ext.")  # not ignite's, which idist re-exports
            ):
                found[value.__name__] = value
    return found


def _headings(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    return [
        title
        for title, under in itertools.pairwise(lines)
        if title.strip() and re.fullmatch(r"([=\-~^\"'])\1{2,}", under) and len(under) >= len(title.rstrip())
    ]


def _glossary_terms() -> set[str]:
    body = GLOSSARY.read_text().split(".. glossary::", 1)[1]
    body = re.split(r"^\S", body, maxsplit=1, flags=re.M)[0]  # the directive ends at the first unindented line
    # A term is a line indented by three spaces (its definition is indented further), not an option.
    return {line.strip().lower() for line in body.splitlines() if re.match(r"^ {3}[^\s:]", line)}


def _message_texts() -> list[str]:
    """The string parts of what the package raises, warns and logs (above DEBUG): the messages users read."""
    texts = []
    for path in (ROOT / "ignite_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            call = node.exc if isinstance(node, ast.Raise) else node
            if not isinstance(call, ast.Call):
                continue
            func = ast.unparse(call.func)
            if not (isinstance(node, ast.Raise) or re.search(r"(warn|warning|info|error|exception)$", func)):
                continue
            parts = [c.value for a in call.args for c in ast.walk(a) if isinstance(c, ast.Constant)]
            texts.append(" ".join(p for p in parts if isinstance(p, str)))
    return texts


def _uses(text: str, term: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(term)}s?(?![\w-])", text, re.IGNORECASE) is not None


def test_the_classes_are_found() -> None:
    found = _public_exceptions()
    # A floor, so that a broken discovery cannot pass by finding nothing.
    assert {"RankFailedError", "RankDiedError", "ShmSpaceError", "ForkDeadlockWarning", "StaleCacheWarning"} <= set(
        found
    ), sorted(found)


@pytest.mark.parametrize("name", sorted(_public_exceptions()))
def test_every_public_error_and_warning_has_its_entry(name: str) -> None:
    titled = [h for h in _headings(TROUBLESHOOTING) if f"``{name}``" in h]
    assert titled, f"docs/troubleshooting.rst has no heading naming ``{name}``: add what it means and what to do"


def test_the_pages_are_in_the_index() -> None:
    index = (DOCS / "index.rst").read_text()
    assert re.search(r"^\s+troubleshooting$", index, re.M) and re.search(r"^\s+glossary$", index, re.M)


def test_every_term_reference_is_defined() -> None:
    terms = _glossary_terms()
    pages = [p for p in DOCS.rglob("*.rst") if "_build" not in p.parts]
    missing = [
        f"{page.relative_to(ROOT)}: {ref}"
        for page in pages
        for ref in re.findall(r":term:`([^`<]+?)(?:\s*<([^>]+)>)?`", page.read_text())
        for ref in [ref[1] or ref[0]]
        if ref.strip().lower() not in terms
    ]
    assert not missing, "terms referenced but not in docs/glossary.rst:\n" + "\n".join(missing)


def test_every_internal_term_used_in_the_docs_or_messages_is_defined() -> None:
    terms = _glossary_terms()
    pages = [ROOT / "README.md", *(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts and p != GLOSSARY)]
    texts = [p.read_text() for p in pages] + _message_texts()
    used = {term for term in INTERNAL_TERMS if any(_uses(text, term) for text in texts)}
    assert used, "no internal term found at all: the scan is broken"
    undefined = sorted(term for term in used if term.lower() not in terms)
    assert not undefined, f"used in the docs or messages but not in docs/glossary.rst: {undefined}"


def test_the_glossary_maps_the_node_axis_in_one_table() -> None:
    text = GLOSSARY.read_text()
    table = text.split(".. list-table::", 1)
    assert len(table) == 2 and text.count(".. list-table::") == 1
    assert all(f"``{spelling}``" in table[1] for spelling in NODE_AXIS), NODE_AXIS
