"""The public API is what __init__ exports, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import crashsafe as cs


def test_all_names_exist() -> None:
    for name in cs.__all__:
        assert hasattr(cs, name), name


def test_import_does_not_pull_heavy_dependencies() -> None:
    heavy = "('torch', 'ray', 'scipy', 'sklearn')"
    code = f"import sys, crashsafe; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
