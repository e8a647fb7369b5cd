"""``import bayesify`` from the parent directory of a checkout (issue 37, item 15).

A clone of the repository is a folder named ``bayesify`` with no ``__init__.py``. With the
package at the repository root (a flat layout) and an editable install, Python found that
folder first — as an empty *namespace package* — from its parent directory:
``ImportError: cannot import name 'load_posterior' from 'bayesify' (unknown location)``.
The package lives in ``src/bayesify`` now, and an editable install puts ``src`` itself on
``sys.path``, where a regular package wins over a namespace portion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_package_is_in_src_and_setuptools_looks_there():
    assert (ROOT / "src" / "bayesify" / "__init__.py").is_file()
    assert not (ROOT / "bayesify").exists(), "the package moved to src/bayesify"
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]


def test_import_from_the_parent_of_a_checkout_named_bayesify(tmp_path):
    neutral = tmp_path / "neutral"
    neutral.mkdir()
    if _python("import bayesify", neutral).returncode != 0:
        pytest.skip("bayesify is not installed in this interpreter (pip install -e .)")
    checkout = tmp_path / "bayesify"  # what `git clone .../bayesify` makes: no __init__.py
    (checkout / "src").mkdir(parents=True)
    (checkout / "README.md").write_text("a checkout\n")
    out = _python("import bayesify\nfrom bayesify import load_posterior, bayesify as wrap\n"
                  "print(bayesify.__file__)", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(os.path.join("bayesify", "__init__.py"))
