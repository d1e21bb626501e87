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


def test_the_extras_ask_for_a_torch_range_and_only_this_repo_pins_it() -> None:
    """``pip install crashsafe[torch]`` must keep a user's torch (a CUDA build, 2.11): the extras
    declare the range crashsafe was tested with; the exact pin is this repository's constraints."""
    import tomllib

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch = [r for reqs in extras.values() for r in map(Requirement, reqs) if r.name == "torch"]
    assert torch, "no extra asks for torch"
    for requirement in torch:
        assert all(s.operator not in ("==", "===", "~=") for s in requirement.specifier), requirement
        assert all(requirement.specifier.contains(v) for v in ("2.11.0", "2.12.1", "2.13.0", "2.14.0"))
        assert not requirement.specifier.contains("2.10.0")  # never tested
    pins = [line.strip() for line in (root / "constraints.txt").read_text().splitlines()]
    assert "torch==2.13.0" in pins
