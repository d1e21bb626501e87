"""The command line, run as a user runs it: the installed ``crashsafe`` console script in a
subprocess, at 80 columns, its stdout a pipe (or a real pseudo-terminal); checkpoints of a real model
trained for a few steps; the JSON schema the package ships; output parsers."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import crashsafe as cs

ROOT = Path(__file__).resolve().parents[2]
BOX = set("│┃─━┏┓┗┛┡┩╇┳┻╋┼┬┴├┤└┘┌┐")
_SCRIPT = Path(sys.executable).with_name("crashsafe")
CRASHSAFE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "crashsafe"]
SCHEMA: dict[str, Any] = json.loads((resources.files("crashsafe.cli") / "schema.json").read_text())
# what the parent's environment must not decide for the child: its width and whether it has a terminal
_DECIDED_HERE = ("COLUMNS", "LINES", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR", "NO_COLOR")


def check_json(text: str, command: str) -> Any:
    """Parse ``text`` as one JSON document (strict: no NaN) and validate it against the schema's
    definition for ``command``."""

    def refuse(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    document = json.loads(text, parse_constant=refuse)
    jsonschema.Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{command}"}).validate(document)
    return document


@dataclass(frozen=True)
class Run:
    """One invocation: exit code, stdout and stderr apart."""

    code: int
    out: str
    err: str


def invoke(*args: str, columns: int = 80, tty: bool = False, timeout: float = 120) -> Run:
    """``crashsafe ARGS`` through the console script in a subprocess, ``columns`` wide: its stdout a
    pipe (COLUMNS set, as a shell sets it), or with ``tty`` a pseudo-terminal of that width."""
    env = {k: v for k, v in os.environ.items() if k not in _DECIDED_HERE}
    if not tty:
        done = subprocess.run(
            [*CRASHSAFE, *args], env={**env, "COLUMNS": str(columns)}, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        return Run(done.returncode, done.stdout, done.stderr)
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [*CRASHSAFE, *args], env={**env, "TERM": "xterm"}, stdin=subprocess.DEVNULL, stdout=child,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(parent, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(parent)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=timeout)
    return Run(code, b"".join(chunks).decode().replace("\r\n", "\n"), err)


def invoke_here(*args: str) -> Run:
    """``crashsafe ARGS`` in this process (typer's runner, stdout not a terminal, 80 columns): for
    tests of what a command computes or refuses, where a subprocess would only add torch's import
    time; every command's output also goes through :func:`invoke`."""
    from typer.testing import CliRunner

    from crashsafe.cli.app import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"}, catch_exceptions=False)
    return Run(result.exit_code, result.stdout, result.stderr)


def assert_fits(text: str, columns: int = 80) -> None:
    """Every line within ``columns`` cells; nothing cut with an ellipsis."""
    from rich.cells import cell_len

    wide = [line for line in text.splitlines() if cell_len(_plain(line)) > columns]
    assert not wide, f"lines wider than {columns}:\n" + "\n".join(wide)
    assert "…" not in text and "..." not in text


def _plain(line: str) -> str:
    """``line`` without ANSI escapes and with box characters as spaces (columns keep their place)."""
    return "".join(" " if c in BOX else c for c in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line))


def first_column(text: str, header: str) -> list[tuple[str, list[str]]]:
    """The rows of the table whose header starts with ``header``: (its first cell with a folded
    cell's lines joined back, the words of the rest of its first line). The first two columns must
    be left-aligned: a row starts where the second one is filled; a line with text in the gap before
    it ends the table."""
    lines = [_plain(line) for line in text.splitlines()]
    top = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    second = lines[top].index(" " + lines[top].split()[1]) + 1
    rows: list[tuple[str, list[str]]] = []
    for line in lines[top + 1 :]:
        if line[second - 2 : second].strip():
            break
        cell, rest = line[:second].strip(), line[second:]
        if rest[:1].strip():
            rows.append((cell, rest.split()))
        elif cell:
            rows[-1] = (rows[-1][0] + cell, rows[-1][1])
    return rows


class Deep(torch.nn.Module):
    """A small transformer under a long attribute name: state paths of 60+ characters."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
        self.transformer_encoder_stack = torch.nn.TransformerEncoder(
            layer, num_layers=2, enable_nested_tensor=False
        )
        self.classification_head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classification_head(self.transformer_encoder_stack(x).mean(1))
        return out


def train(directory: Path | str, steps: int = 3, **manager: Any) -> list[str]:
    """Train ``Deep`` with AdamW for ``steps`` steps, saving each with its loss and accuracy; return
    the state paths of the last step."""
    torch.manual_seed(0)
    model = Deep()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 5, 16), torch.randint(0, 4, (32,))
    with cs.CheckpointManager(directory, keep_last=None, **manager) as mgr:
        for step in range(1, steps + 1):
            optim.zero_grad()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            optim.step()
            accuracy = float((logits.argmax(1) == y).float().mean())
            mgr.save(
                step,
                {"model": model, "optim": optim, "step": step},
                {"loss": float(loss.detach()), "accuracy": accuracy},
            )
        mgr.wait()
        return [p.path for p in mgr.manifest(steps).payloads]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A checkpoint of three steps of ``Deep`` (zstd for the model) and the paths of its last step."""
    directory = tmp_path_factory.mktemp("cli") / "run"
    paths = train(directory, codec={"model.*": "zstd", "*": "raw"})
    return directory, paths
