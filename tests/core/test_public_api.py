"""The public API is what __init__ exports, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import crashsafe as cs


def test_all_names_exist() -> None:
    for name in cs.__all__:
        assert hasattr(cs, name), name


def test_import_does_not_pull_heavy_dependencies() -> None:
    heavy = "('torch', 'ray', 'scipy', 'sklearn')"
    code = f"import sys, crashsafe; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_numpy_only_manager_never_imports_torch(tmp_path: Path) -> None:
    """Saving and restoring numpy state must not pay for importing torch (seconds in a fresh
    process; a standby parameter server opened its first manager during recovery)."""
    code = (
        "import sys, numpy as np, crashsafe as cs\n"
        f"with cs.CheckpointManager({str(tmp_path)!r}, async_save=False) as mgr:\n"
        "    mgr.save(1, {'w': np.ones(3)}); mgr.restore({'w': np.zeros(3)})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
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
