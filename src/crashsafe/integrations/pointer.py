"""Pointer files: what stands at a Lightning checkpoint path (``last.ckpt``) when crashsafe holds it.

The checkpoint itself lives in a crashsafe store beside it (``.crashsafe/``); the pointer file names
it, so Lightning's own file logic (``ModelCheckpoint`` top-k, versions, ``ckpt_path="last"``) works
as with its own files. A pointer names one step of that store by number and by a random key the
step holds too, so a pointer renamed or copied within its folder loads exactly that step, and one
whose step is gone is known to dangle. A pointer is not a torch file: its first two lines make
``torch.load`` (and so ``LightningModule.load_from_checkpoint``) fail with a message saying what to
call instead. To pickle they read as a GLOBAL of ``crashsafe.<message>``; with ``weights_only=True``
torch refuses it by name, and with ``weights_only=False`` Python imports crashsafe and fails to find
an attribute named by that sentence. Nothing of the file runs, and crashsafe reads the last line as JSON.

When Lightning removes a checkpoint, its pointer is renamed to a *removal mark* (``.<name>`` +
``REMOVED``) before its steps are deleted: a crash in between leaves the mark, so the next writer
knows those steps were let go rather than moved away by the user (``scan``).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from crashsafe.errors import CrashsafeError

__all__ = [
    "MESSAGE",
    "REMOVED",
    "STORE",
    "Folder",
    "Pointer",
    "is_pointer",
    "mark_removed",
    "names_itself",
    "read_pointer",
    "retire_pointer",
    "scan",
    "unmark",
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
REMOVED = ".crashsafe-removed"  # the suffix of a removal mark
_TMP = ".crashsafe-tmp"  # the suffix of a pointer being written


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the file name its checkpoint was saved as, and the step it names
    with that step's key; ``committed`` once the step was. A pointer written by an older crashsafe
    (or an empty file a power loss cut short) names no step: it loads the newest step saved as
    ``name``."""

    name: str
    step: int | None = None
    key: str | None = None
    committed: bool = False


@dataclass(frozen=True)
class Folder:
    """The pointer files of a checkpoint folder (by file name) and the names of its removal marks."""

    pointers: dict[str, Pointer]
    removed: frozenset[str]


def write_pointer(path: Path, pointer: Pointer, *, durable: bool = True) -> None:
    """Atomically (write, rename) make ``path`` hold ``pointer``. ``durable`` fsyncs the file before
    the rename and the directory after, so a power loss keeps it; without, it survives a crash of the
    process (enough before its step commits: the pointer is written durably again then). A durable
    write is also new: Lightning resumes ``ckpt_path="last"`` from the newest-modified candidate."""
    record = {"crashsafe": STORE, "name": pointer.name, "step": pointer.step, "key": pointer.key}
    record["committed"] = pointer.committed
    body = _HEAD + f"{MESSAGE}\n".encode() + json.dumps(record).encode() + b"\n"
    tmp = path.with_name(f".{path.name}{_TMP}")
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


def names_itself(path: Path) -> bool:
    """True if ``path`` is a regular file (not a link) holding a pointer to its own name."""
    fd = _open_own(path)
    if fd is None:
        return False
    try:
        pointer = _parse(os.read(fd, _MAX_BYTES))
    finally:
        os.close(fd)
    return pointer is not None and pointer.name == path.name


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


def retire_pointer(path: Path) -> None:
    """Durably replace the pointer at ``path`` (whatever stands there) by its removal mark; where
    nothing does, make the mark: the steps saved as its name are let go."""
    try:
        os.replace(path, _mark_path(path))
    except FileNotFoundError:
        mark_removed(path)
    except OSError:  # a directory at the mark's path: the pointer goes unmarked
        path.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def mark_removed(path: Path) -> None:
    """An empty removal mark for ``path`` (not durable): the steps saved as its name may go. Where
    it cannot be made (a directory at its path), none is: a crash then leaves those steps kept."""
    mark = _mark_path(path)
    with contextlib.suppress(OSError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mark)  # a link or a FIFO there is replaced, never written through
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))


def unmark(path: Path) -> None:
    """Remove the removal mark of ``path`` if there is one (not durably: a mark left behind only
    lets go of steps no pointer names); one that cannot be removed stays."""
    with contextlib.suppress(OSError):
        os.unlink(_mark_path(path))


def _mark_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{REMOVED}")


def scan(folder: Path) -> Folder:
    """The pointer files and removal marks (regular files) in ``folder``, not below it. Only regular
    files of at most a pointer's size are read, by themselves: a link is never followed (a link in a
    Lightning folder points at a pointer there, or outside the folder) and a FIFO never opened. An
    empty file counts as a pointer to its own name (:class:`Pointer`). OSError if the folder cannot
    be listed."""
    pointers: dict[str, Pointer] = {}
    removed: set[str] = set()
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(_TMP):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                if name.startswith(".") and name.endswith(REMOVED) and len(name) > len(REMOVED) + 1:
                    removed.add(name[1 : -len(REMOVED)])
                    continue
                if entry.stat(follow_symlinks=False).st_size > _MAX_BYTES:
                    continue
            except OSError:
                continue  # gone since it was listed
            fd = _open_own(folder / name)
            if fd is None:
                continue
            try:
                data = os.read(fd, _MAX_BYTES)
            finally:
                os.close(fd)
            pointer = Pointer(name) if not data else _parse(data)
            if pointer is not None:
                pointers[name] = pointer
    return Folder(pointers, frozenset(removed))


def is_pointer(path: Path) -> bool:
    """True if ``path`` (or the file a link there points to) is a crashsafe pointer file."""
    data = _read_regular(path, len(_HEAD))
    return data is not None and data == _HEAD


def read_pointer(path: Path) -> Pointer:
    """What the pointer file at ``path`` (or the file a link there points to) says."""
    data = _read_regular(path, _MAX_BYTES)
    if data is None:
        raise CrashsafeError(f"{path} is not a crashsafe pointer file (nothing there, or not a file)")
    pointer = _parse(data)
    if pointer is None:
        raise CrashsafeError(
            f"{path} starts like a crashsafe pointer file but is damaged; its checkpoints are in "
            f"{path.parent / STORE} (`crashsafe ls` lists them)"
        )
    return pointer


def _parse(data: bytes) -> Pointer | None:
    """The pointer a file's bytes hold; None if they are not a whole pointer. One without a step
    (or with a step or key of the wrong type) names its checkpoint by name only."""
    if not data.startswith(_HEAD):
        return None
    try:
        record = json.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except ValueError:
        return None
    if (
        not isinstance(record, dict)
        or record.get("crashsafe") != STORE
        or not isinstance(record.get("name"), str)
    ):
        return None
    pointer = Pointer(record["name"])
    step, key = record.get("step"), record.get("key")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0 and isinstance(key, str):
        pointer = replace(pointer, step=step, key=key, committed=record.get("committed") is True)
    return pointer


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
