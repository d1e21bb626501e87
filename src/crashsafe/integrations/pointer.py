"""Pointer files: what stands at a Lightning checkpoint path (``last.ckpt``) when crashsafe holds it.

The checkpoint itself lives in a crashsafe store beside it (``.crashsafe/``); the pointer file names
it, so Lightning's own file logic (``ModelCheckpoint`` top-k, versions, ``ckpt_path="last"``) works
as with its own files. A pointer is not a torch file: its first two lines make ``torch.load`` (and
so ``LightningModule.load_from_checkpoint``) fail with a message saying what to call instead. To
pickle they read as a GLOBAL of ``crashsafe.<message>``; with ``weights_only=True`` torch refuses it
by name, and with ``weights_only=False`` Python imports crashsafe and fails to find an attribute
named by that sentence. Nothing of the file runs, and crashsafe reads the last line as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from crashsafe.errors import CrashsafeError

__all__ = [
    "MESSAGE",
    "STORE",
    "is_pointer",
    "names_itself",
    "pointed_name",
    "remove_pointer",
    "settle_pointer",
    "write_pointer",
]

STORE = ".crashsafe"
MESSAGE = (
    "this .ckpt is a crashsafe checkpoint, not a torch.save file: load it with "
    "crashsafe.integrations.lightning.load_checkpoint(path), or "
    "crashsafe.integrations.lightning.load_from_checkpoint(ModelClass, path), or resume with "
    "Trainer(plugins=[crashsafe.integrations.lightning.CrashsafeCheckpointIO()])"
)
_HEAD = b"ccrashsafe\n"
_MAX_BYTES = 4096


def write_pointer(path: Path, name: str, *, durable: bool = True) -> None:
    """Atomically (write, rename) make ``path`` point at ``name``. ``durable`` fsyncs the file before
    the rename and the directory after, so a power loss keeps it; without, it survives a crash of the
    process (enough before its step commits: ``settle_pointer`` makes it durable then)."""
    body = _HEAD + f"{MESSAGE}\n".encode() + json.dumps({"crashsafe": STORE, "name": name}).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.crashsafe-tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # what a killed save left at this name (a FIFO there would block an open)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, body)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def settle_pointer(path: Path, name: str) -> None:
    """Make the pointer at ``path`` durable with its mtime now: Lightning resumes ``ckpt_path="last"``
    from the newest-modified candidate, so a re-saved ``last.ckpt`` must look new. A pointer to
    ``name`` already there is touched and fsynced (its bytes stay); anything else is replaced."""
    fd = _open_own(path)
    mine = False
    if fd is not None:
        try:
            mine = _named(os.read(fd, _MAX_BYTES)) == name
            if mine:
                os.utime(fd)
                os.fsync(fd)
        finally:
            os.close(fd)
    if mine:
        _fsync_dir(path.parent)  # its name may come from a write_pointer(durable=False)
    else:
        write_pointer(path, name)  # nothing there, a link, a FIFO, or another file


def names_itself(path: Path) -> bool:
    """True if ``path`` is a regular file (not a link) holding a pointer to its own name."""
    fd = _open_own(path)
    if fd is None:
        return False
    try:
        return _named(os.read(fd, _MAX_BYTES)) == path.name
    finally:
        os.close(fd)


def _open_own(path: Path) -> int | None:
    """A read-only fd of the regular file at ``path`` itself (never a link's target, never waiting
    on a FIFO); None if something else, or nothing, is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def remove_pointer(path: Path) -> None:
    """Remove a pointer file (durably), if it is there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)


def is_pointer(path: Path) -> bool:
    """True if ``path`` (or the file a link there points to) is a crashsafe pointer file."""
    data = _read_regular(path, len(_HEAD))
    return data is not None and data == _HEAD


def pointed_name(path: Path) -> str:
    """The checkpoint name a pointer file at ``path`` stands for."""
    data = _read_regular(path, _MAX_BYTES)
    if data is None:
        raise CrashsafeError(f"{path} is not a crashsafe pointer file (nothing there, or not a file)")
    name = _named(data)
    if name is None:
        raise CrashsafeError(
            f"{path} starts like a crashsafe pointer file but is damaged; its checkpoints are in "
            f"{path.parent / STORE} (`crashsafe ls` lists them)"
        )
    return name


def _named(data: bytes) -> str | None:
    """The name a pointer file's bytes hold; None if they are not a whole pointer."""
    if not data.startswith(_HEAD):
        return None
    try:
        record = json.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except ValueError:
        return None
    if isinstance(record, dict) and record.get("crashsafe") == STORE and isinstance(record.get("name"), str):
        name: str = record["name"]
        return name
    return None


def _read_regular(path: Path, limit: int) -> bytes | None:
    """Up to ``limit`` bytes of the regular file at ``path`` (links followed); None if there is none
    there. A FIFO or a device is never read (an open of a FIFO would wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CrashsafeError(f"{path} cannot be read ({exc.strerror}); check its permissions") from None
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
