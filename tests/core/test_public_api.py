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


def test_import_leaves_the_simulator_the_cli_and_plotting_for_later() -> None:
    lazy = "('crashsafe.sim', 'crashsafe.cli', 'matplotlib', 'typer', 'rich')"
    code = f"import sys, crashsafe; print(sorted(m for m in {lazy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert cs.sim.Hindsight is not None  # imported on first use


def test_every_warning_has_one_base_class() -> None:
    import crashsafe.policies
    import crashsafe.ps.errors

    warnings = [cs.CorruptCheckpointWarning, cs.ShelfRecoveredWarning, crashsafe.policies.PolicyWarning]
    warnings.append(crashsafe.ps.errors.DataLossWarning)
    assert all(issubclass(w, cs.CrashsafeWarning) and issubclass(w, UserWarning) for w in warnings)


def test_the_verify_function_does_not_hide_its_module() -> None:
    import crashsafe.verification

    assert callable(cs.verify) and cs.verify is crashsafe.verification.verify
