"""Sphinx configuration for ignite_ext."""

import ignite_ext

project = "ignite_ext"
author = "ignite_ext contributors"
copyright = "2026, ignite_ext contributors"
version = release = ignite_ext.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
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
