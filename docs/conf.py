"""Sphinx configuration for ignite_ext."""

import sys
from pathlib import Path

import ignite_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))  # the docs' own extensions

project = "ignite_ext"
author = "ignite_ext contributors"
copyright = "2026, ignite_ext contributors"
version = release = ignite_ext.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "settings_table",
]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
nitpicky = False
intersphinx_mapping: dict[str, tuple[str, None]] = {}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
suppress_warnings = ["ref.python"]
