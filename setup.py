"""Packaging for ignite_ext; tool settings live in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

_HERE = Path(__file__).parent
_VERSION = {}
exec((_HERE / "ignite_ext" / "_version.py").read_text(), _VERSION)

_TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "numpy>=1.26",
    "psutil>=5.9",
    # tests/test_packaging.py builds the sdist and the wheel and checks them as an index would.
    "build>=1.2",
    "twine>=6.1",
]
_DEV = [*_TEST, "mypy>=1.10", "ruff>=0.6", "sphinx>=7.2", "matplotlib>=3.8"]

setup(
    name="ignite_ext",
    version=_VERSION["__version__"],
    description="Rank scheduling, race-free downloads and cached DDP data loading on top of ignite.distributed",
    long_description=(_HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # An SPDX expression (PEP 639), which supersedes the license classifiers: setuptools refuses both.
    license_expression="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.11,<3.14",  # ran green: 3.11-3.13; 3.14 never ran (docs/backends.rst, "Versions")
    packages=find_packages(include=["ignite_ext", "ignite_ext.*"]),
    package_data={"ignite_ext": ["py.typed"]},
    install_requires=[
        # What scripts/compat.sh ran green (docs/backends.rst, "Versions"): torch 2.1.2-2.14.1, ignite 0.5.1-0.5.5.
        "torch>=2.1,<2.15",
        "pytorch-ignite>=0.5.1,<0.6",
        # The download lock where fcntl is missing; elsewhere it is the package's own record lock (ignite_ext._locks).
        'filelock>=3.20.3; sys_platform == "win32"',
        "tqdm>=4.60",
        "numpy>=1.26",
    ],
    extras_require={"test": _TEST, "dev": _DEV},
    entry_points={"console_scripts": ["ignite-ext=ignite_ext.__main__:main"]},
    # No project_urls: the project has no public homepage, repository or documentation site to point to.
    classifiers=[
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        # /dev/shm, memfd, pidfd and fcntl locks: Linux (only the download path also imports on Windows).
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
)
