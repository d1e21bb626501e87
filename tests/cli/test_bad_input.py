"""Bad input on the command line: a clear error that names the problem and the next step, exit 2, no
traceback and no hang (each case found by an audit, where it was a traceback or a hang)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import crashsafe as cs

from .conftest import Run, invoke, invoke_here

_MAX_STEP = 2**63 - 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three small numpy steps."""
    directory = tmp_path_factory.mktemp("bad") / "run"
    with cs.CheckpointManager(directory, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.arange(4.0) * step, "step": step})
    return directory


def _clear_error(run: Run, *words: str) -> str:
    """The one-line stderr of a run that failed as the CLI fails on bad input (exit 2, no traceback)."""
    text = " ".join(run.err.split())
    assert run.code == 2, (run.code, run.out, run.err)
    assert text.startswith("error:") and "Traceback" not in run.err and not run.out, run.err
    for word in words:
        assert word in text, text
    return text


@pytest.mark.parametrize(
    ("args", "option", "value"),
    [
        (["show", "{d}", "--step", "-1"], "--step", "-1"),
        (["show", "{d}", "-s", str(10**23)], "--step", str(10**23)),
        (["export", "{d}", "-o", "{o}", "--step", "-5"], "--step", "-5"),
        (["export", "{d}", "-o", "{o}", "--step", str(_MAX_STEP + 1)], "--step", str(_MAX_STEP + 1)),
        (["diff", "{d}", "--", "-1", "2"], "step A", "-1"),
        (["diff", "{d}", "1", str(2**64)], "step B", str(2**64)),
        (["diff", "{d}", "{d}", "--step-a", "-1"], "--step-a", "-1"),
        (["diff", "{d}", "{d}", "--step-b", str(2**63)], "--step-b", str(2**63)),
    ],
)
def test_a_step_outside_0_to_2_63_is_a_clear_error(
    ckpt: Path, tmp_path: Path, args: list[str], option: str, value: str
) -> None:
    """It was a ValueError traceback from the format's step names (exit 1)."""
    run = invoke_here(*(a.format(d=ckpt, o=tmp_path / "x.safetensors") for a in args))
    _clear_error(run, f"{option} {value} is not a step number", str(_MAX_STEP), "crashsafe ls")
    assert not (tmp_path / "x.safetensors").exists()
    assert invoke_here("show", str(ckpt), "--step", "0").code == 2  # in range, not committed: as before
    assert invoke_here("show", str(ckpt), "--step", "2").code == 0


def test_the_step_help_says_the_default_may_be_a_damaged_step(ckpt: Path) -> None:
    """show and export read the newest step even when it is damaged; the help said 'newest intact'."""
    for command in ("show", "export"):
        text = " ".join(invoke_here(command, "--help").out.replace("│", " ").split())
        assert "newest intact" not in text
        assert "the newest committed step, even a damaged one" in text


@pytest.mark.parametrize("kind", ["file", "fifo"])
@pytest.mark.parametrize("command", ["ls", "show", "verify"])
def test_a_file_or_fifo_as_the_checkpoint_directory_says_so(tmp_path: Path, kind: str, command: str) -> None:
    """It said '[Errno 20] I/O error while opening the checkpoint directory ...: Not a directory'."""
    path = tmp_path / "notadir"
    if kind == "file":
        path.write_text("x")
    else:
        os.mkfifo(path)
    text = _clear_error(invoke_here(command, str(path)), f"{path} is not a directory", "checkpoint directory")
    assert "Errno" not in text and "I/O error" not in text


def test_a_file_where_a_writer_would_create_its_directory_says_so(tmp_path: Path) -> None:
    """It said '[Errno 17] I/O error while creating the checkpoint directory ...: File exists'."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(cs.StorageError, match="afile is not a directory") as caught:
        cs.CheckpointManager(tmp_path / "afile")
    assert "Errno" not in str(caught.value) and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--codec", "bogus"], ["unknown codec 'bogus'", "known codecs"]),
        (["--kills", "-1"], ["--kills -1", "0 or more"]),
        (["--steps", "0"], ["--steps 0", "at least 1 step"]),
        (["--steps", "0", "--kills", "0"], ["--steps 0", "at least 1 step"]),
        (["--steps", "12", "--kills", "3"], ["--kills 3 needs --steps 14 or more"]),
        (["--directory", "{file}"], ["exists and is not a directory", "--directory"]),
        (["--directory", "{file}/work"], ["cannot prepare the demo's work directory", "Not a directory"]),
    ],
)
def test_demo_refuses_bad_options_before_training(tmp_path: Path, args: list[str], words: list[str]) -> None:
    """A CodecError, NotADirectoryError, ValueError (random.sample) or NoCheckpointError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = invoke_here("demo", *(a.format(file=afile) for a in args))
    _clear_error(run, *words)
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


_SIMULATE = ("simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--trials", "20", "--steps", "300")


def test_simulate_refuses_a_fifo_as_its_loss_curve_or_trace(tmp_path: Path) -> None:
    """A blocking open of the FIFO waited forever for a writer (in a subprocess, so the old code
    fails the test by its timeout rather than hang the run)."""
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    plot = str(tmp_path / "p.png")
    curve = invoke(*_SIMULATE, "--job", "1h", "--loss-curve", str(fifo), "--plot", plot, timeout=60)
    _clear_error(curve, f"loss curve {fifo} is not a regular file")
    trace = invoke(*_SIMULATE, "--failures", f"trace:{fifo}", "--plot", plot, timeout=60)
    _clear_error(trace, f"failure trace {fifo} is not a regular file")
    assert not (tmp_path / "p.png").exists()


def test_simulate_refuses_a_plot_target_it_cannot_or_must_not_write(tmp_path: Path) -> None:
    """A missing folder was a FileNotFoundError traceback after the whole simulation; a FIFO was
    opened for writing (a hang, or io.UnsupportedOperation); a directory made matplotlib write
    DIR.png while the command said it wrote DIR."""
    fifo, folder = tmp_path / "fifo.png", tmp_path / "plots"
    os.mkfifo(fifo)
    folder.mkdir()
    missing = invoke(*_SIMULATE, "--plot", str(tmp_path / "nodir" / "p.png"), timeout=60)
    _clear_error(missing, "nodir is not an existing folder", "create it")
    _clear_error(invoke(*_SIMULATE, "--plot", str(fifo), timeout=60), "is not a regular file")
    _clear_error(invoke(*_SIMULATE, "--plot", str(folder), timeout=60), f"e.g. {folder / 'simulate.png'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.png", "plots"] and not any(folder.iterdir())
    bare = tmp_path / "plot"  # no suffix: written where asked, not at plot.png
    done = invoke(*_SIMULATE, "--plot", str(bare), timeout=60)
    assert done.code == 0, done.err
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote the plot to {bare}" in " ".join(done.out.split())


def test_simulate_never_writes_the_plot_through_a_link_nor_over_a_hard_link(
    tmp_path: Path, ckpt: Path
) -> None:
    """``--plot`` (default ``simulate.png`` in the current folder) was opened by path, following a
    link: a ``simulate.png`` linked to a committed step's manifest was overwritten with the PNG (the
    step then failed verification, the command said "wrote the plot"). A symbolic link is refused
    untouched; a hard link is replaced by a rename, so the file it shares bytes with keeps them."""
    manifest = ckpt / f"step_{1:012d}" / "manifest.json"
    before = manifest.read_bytes()
    link = tmp_path / "simulate.png"
    link.symlink_to(manifest)
    _clear_error(invoke(*_SIMULATE, "--plot", str(link), timeout=60), "is a symbolic link")
    hard = tmp_path / "hard.png"
    os.link(manifest, hard)
    done = invoke(*_SIMULATE, "--plot", str(hard), timeout=60)
    assert done.code == 0, done.err
    assert hard.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and manifest.read_bytes() == before
    assert link.is_symlink() and cs.verify(ckpt).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.png", "simulate.png"]  # no temporary left


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--job", "0"], ["--job 0", "must train for some time"]),  # ZeroDivisionError
        (["--steps", "0"], ["--steps 0", "at least 1 step"]),  # ZeroDivisionError
        (["--policy", ","], ["names no policy"]),  # IndexError
    ],
)
def test_simulate_refuses_a_run_with_nothing_to_simulate(
    tmp_path: Path, args: list[str], words: list[str]
) -> None:
    plot = str(tmp_path / "p.png")
    _clear_error(invoke_here("simulate", "--mtbf", "4h", "--ckpt-cost", "30s", "--plot", plot, *args), *words)


@pytest.mark.parametrize(
    "args",
    [
        ["--ckpt-cost", "1e308s"],  # OverflowError
        ["--ckpt-cost", "inf"],
        ["--ckpt-cost", "30s", "--job", "1e300s"],
        ["--ckpt-cost", "30s", "--persist", "1e200s"],
    ],
)
def test_simulate_refuses_a_duration_past_a_century(tmp_path: Path, args: list[str]) -> None:
    """An OverflowError traceback (1e308 s), or minutes of trials failing up to the engine's cap."""
    plot = tmp_path / "p.png"
    run = invoke_here("simulate", "--mtbf", "4h", "--plot", str(plot), *args)
    _clear_error(run, args[-2], "up to 100 years", "e.g. --ckpt-cost 30s")
    assert not plot.exists()


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then closed at once)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("command", ["ls", "verify", "show", "gc", "diff", "export"])
def test_a_url_whose_backend_cannot_open_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """ftp:// refused: a ConnectionRefusedError traceback; zip:// and tar:// without their archive:
    FileNotFoundError or IsADirectoryError tracebacks. Each names the URL, exit 2."""
    monkeypatch.chdir(tmp_path)
    urls = [
        f"ftp://127.0.0.1:{_closed_port()}/run",
        "zip://run",
        "tar://run",
        f"zip://run::file://{tmp_path}/missing.zip",
        f"tar://run::file://{tmp_path}/missing.tar",
    ]
    extra = {"diff": ["1", "2"], "export": ["-o", str(tmp_path / "x.safetensors")]}.get(command, [])
    for url in urls:
        _clear_error(invoke_here(command, url, *extra), f"cannot open {url}", "Check the URL")
    assert list(tmp_path.iterdir()) == []


def test_brackets_in_paths_names_and_hints_are_printed_as_they_are(tmp_path: Path) -> None:
    """Errors, ``ls`` headers and ``shelf inspect`` went through rich markup: a location or a metric
    or shelf variable named with ``[/]`` was a MarkupError traceback (exit 1), ``run[a]`` was printed
    as ``run``, and the hint "pip install 'crashsafe[torch]'" as "pip install 'crashsafe'"."""
    for where in ("a[/]b", "run[bold]x"):
        _clear_error(invoke_here("ls", str(tmp_path / where)), f"{tmp_path / where} does not exist")
    run = tmp_path / "run"
    with cs.CheckpointManager(run) as mgr:
        mgr.save(1, {"a[/]b": np.ones(2)}, metrics={"[/]": 1.0, "loss[red]": 2.0})
    listed = invoke_here("ls", str(run))
    assert listed.code == 0 and "Traceback" not in listed.err, listed.err
    assert "[/]" in listed.out and "loss[red]" in listed.out, listed.out
    shelf = tmp_path / "s.shelf"
    with cs.Shelf(shelf, size="1MiB") as s:
        s["a[/]b"] = 1
        s["[bold]v"] = "[/]"
    shown = invoke_here("shelf", "inspect", str(shelf))
    assert shown.code == 0 and "a[/]b" in shown.out and "[bold]v" in shown.out, (shown.out, shown.err)


def test_simulate_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib comes with the science extra: a plain install ran the whole simulation, then failed
    on a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, as where missing
    plot = tmp_path / "p.png"
    _clear_error(invoke_here(*_SIMULATE, "--plot", str(plot)), "pip install 'crashsafe[science]'")
    assert not plot.exists()
