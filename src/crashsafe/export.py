"""Export a step's tensors to a safetensors file (or a Hugging Face model folder), checksums verified.

Tensors are named by their dotted state paths; ``prefix`` selects the ones under it and is
stripped, so ``prefix="model."`` gives the names ``model.state_dict()`` has and the file loads with
``load_state_dict(strict=True)``. Views (tied weights) are exported under each of their names.
Every tensor is read through its delta chain and references, so the file holds every byte it
exports: it stands alone, even where the step keeps bytes in earlier steps (docs/format.md).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crashsafe._closing import Closing
from crashsafe.chain import ChainReader
from crashsafe.distributed.shards import read_sharded
from crashsafe.errors import CrashsafeError, NoCheckpointError
from crashsafe.format.manifest import Manifest
from crashsafe.state.rebuild import array_nodes, unflatten, view_of
from crashsafe.storage.layout import parse_step_name
from crashsafe.storage.stores import open_store

__all__ = ["HF_CONFIG_KEY", "export_hf", "export_safetensors"]

HF_CONFIG_KEY = "hf_config"  # a state's model config (``model.config.to_dict()``), for --hf-dir
_MODEL, _CONFIG = "model.safetensors", "config.json"  # what --hf-dir writes
Progress = Callable[[int, int], None]


def export_safetensors(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "",
    keep_prefix: bool = False,
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int, int]:
    """Write the tensors of ``step`` (default newest) under ``prefix`` to ``output`` with the prefix
    stripped (kept with ``keep_prefix``); return (step, count, bytes). Bytes and python values are
    not exported."""
    _require_safetensors()
    out = Path(output)
    _check_output(out, directory)
    found, manifest, arrays = _read(directory, step, storage_options)
    tensors, bf16 = _tensors(manifest, arrays, prefix, keep_prefix, progress)
    with _Outputs(out.parent) as outputs:
        _save(tensors, bf16, outputs.draft(out.name), found)
        outputs.publish()
    return found, len(tensors), sum(a.nbytes for a in tensors.values())


def export_hf(
    directory: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "model.",
    progress: Progress | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[int, int, int, bool]:
    """A folder ``from_pretrained`` reads: ``model.safetensors`` (the tensors under ``prefix``, prefix
    stripped) and, if the state holds ``hf_config``, ``config.json``. Returns (step, count, bytes,
    whether a config was written)."""
    _require_safetensors()
    out = Path(folder)
    if os.path.lexists(out) and not out.is_dir():
        raise CrashsafeError(f"{out} exists and is not a directory; give a folder for --hf-dir")
    for name in (_MODEL, _CONFIG):
        _check_output(out / name, directory, folder_made_here=True)
    found, manifest, arrays = _read(directory, step, storage_options)
    tensors, bf16 = _tensors(manifest, arrays, prefix, False, progress)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CrashsafeError(f"cannot create the folder {out}: {exc.strerror or exc}") from None
    tree = manifest.tree
    config = None
    if tree["t"] == "dict" and HF_CONFIG_KEY in tree["keys"]:
        config = unflatten(tree["vals"][tree["keys"].index(HF_CONFIG_KEY)], arrays)
    with _Outputs(out) as outputs:
        _save(tensors, bf16, outputs.draft(_MODEL), found)
        if isinstance(config, dict):
            text = json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"
            try:
                Path(outputs.draft(_CONFIG)).write_text(text)
            except OSError as exc:
                raise CrashsafeError(f"writing {out / _CONFIG} failed: {exc.strerror or exc}") from None
        outputs.publish()
    return found, len(tensors), sum(a.nbytes for a in tensors.values()), isinstance(config, dict)


def _require_safetensors() -> None:
    """CrashsafeError, before anything is read, where the safetensors package is missing (it comes
    with ``crashsafe[torch]``; a plain install has the command but not the package)."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CrashsafeError(
            "export writes safetensors files and needs the safetensors package: pip install "
            "'crashsafe[torch]' (or just safetensors for tensors other than bfloat16)"
        ) from None


def _read(
    directory: str | os.PathLike[str], step: int | None, storage_options: Mapping[str, Any] | None
) -> tuple[int, Manifest, list[np.ndarray[Any, Any]]]:
    store = open_store(directory, storage_options=storage_options, existing=True)
    try:
        if step is None:
            steps = store.steps()
            if not steps:
                raise NoCheckpointError(f"no committed checkpoint in {directory}")
            step = steps[-1]
        with ChainReader(store) as chains:  # verified, and through delta chains
            manifest = chains.manifest(step)
            arrays: list[Any] = [None] * len(manifest.payloads)
            for _, node in array_nodes(manifest.tree):
                if arrays[node["id"]] is None:
                    arrays[node["id"]] = _whole(chains, manifest, node["id"])
    finally:
        store.close()
    return step, manifest, arrays


def _whole(chains: ChainReader, manifest: Manifest, index: int) -> np.ndarray[Any, Any]:
    """Payload ``index`` decoded (storage dtype); a shard of a distributed step is assembled with
    the other ranks' shards into the whole tensor."""
    entry = manifest.payloads[index]
    if entry.shard is None:
        return chains.decode(manifest.step, entry)  # type: ignore[no-any-return]
    return read_sharded(chains, manifest, entry, None, numpy=True)  # type: ignore[no-any-return]


def _tensors(
    manifest: Manifest,
    arrays: list[np.ndarray[Any, Any]],
    prefix: str,
    keep_prefix: bool,
    progress: Progress | None,
) -> tuple[dict[str, np.ndarray[Any, Any]], set[str]]:
    """The arrays under ``prefix`` by export name (a view becomes a contiguous copy of its values),
    and the names of the bfloat16 ones (stored as uint16)."""
    chosen = [(path, node) for path, node in array_nodes(manifest.tree) if path.startswith(prefix)]
    chosen = [(path, node) for path, node in chosen if manifest.payloads[node["id"]].kind != "bytes"]
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    bf16 = set()
    for i, (path, node) in enumerate(chosen):
        entry = manifest.payloads[node["id"]]
        if entry.dtype.startswith("float8"):
            raise CrashsafeError(f"{path}: float8 tensors cannot be exported to safetensors")
        name = path if keep_prefix else path[len(prefix) :]
        if not name:
            raise CrashsafeError(
                f"{path!r} is the prefix itself: stripped, it has no name. Use --keep-prefix"
            )
        if entry.dtype == "bfloat16":
            bf16.add(name)
        array = arrays[node["id"]]
        tensors[name] = array if node["t"] == "array" else np.ascontiguousarray(view_of(array, node))
        if progress is not None:
            progress(i + 1, len(chosen))
    if not tensors:
        raise NoCheckpointError(f"step {manifest.step} has no tensors under prefix {prefix!r}")
    return tensors, bf16


def _check_output(output: Path, directory: str | os.PathLike[str], folder_made_here: bool = False) -> None:
    """Refuse, before reading anything, a file to export to that is there and is not a regular file
    (a link, even to a file, a FIFO, a directory, a device: export never writes through one nor
    replaces one), or that is a local checkpoint directory's own entry (a step, the lock, a
    temporary) or inside one. An existing regular file is replaced, as ``cp`` replaces one (by a
    rename: its bytes are never written over). Its folder must exist, unless ``folder_made_here``
    (``--hf-dir`` makes it)."""
    try:
        mode: int | None = os.lstat(output).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:
        raise CrashsafeError(f"cannot write {output}: {exc.strerror or exc}; give another path") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise CrashsafeError(
            f"{output} is {_kind(mode)}, not a file export may replace: it never writes through a link nor "
            "into a FIFO, directory or device, and never replaces one. Remove it or give another path"
        )
    if not folder_made_here and not output.parent.is_dir():
        raise CrashsafeError(f"the directory of {output} does not exist; create it first")
    root = _local_root(directory)
    where = Path(os.path.realpath(output.parent)) / output.name
    if root is not None and where.is_relative_to(root):
        name = where.relative_to(root)
        if len(name.parts) != 1 or name.name.startswith(".") or parse_step_name(name.name) is not None:
            raise CrashsafeError(
                f"{output} is one of the checkpoint directory's own entries, or inside one: writing there "
                "could replace a committed step's files. Export somewhere else"
            )


def _local_root(directory: str | os.PathLike[str]) -> Path | None:
    """Where a checkpoint on this machine's file system is: a path, or a ``file://``/``local://`` URL
    (the same directory through the object-store protocol, whose steps are as committed); None for
    another store. realpath, not Path.resolve: a link loop must not raise (RuntimeError) before the
    store says so."""
    text = os.fspath(directory)
    if "://" not in text:
        return Path(os.path.realpath(text))
    protocol, _, rest = text.partition("://")
    if protocol.lower() not in ("file", "local"):
        return None
    return Path(os.path.realpath(rest.split("::", 1)[0]))


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"


class _Outputs(Closing):
    """The files of one export, written in a private folder made inside their destination folder
    (``.crashsafe-export-*``, mode 0700: nothing else is in it, so writing there by path cannot
    meet a link or a FIFO), made durable, then each renamed over its target: a rename never
    follows a link at the target and never opens it; a target that is not a regular file by then
    is refused. The private folder is removed at the end (a kill leaves it behind: delete it)."""

    def __init__(self, folder: Path) -> None:
        try:
            self._fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's choice
        except OSError as exc:
            raise CrashsafeError(f"cannot write into {folder}: {exc.strerror or exc}") from None
        self._folder = folder
        try:
            self._scratch = tempfile.mkdtemp(prefix=".crashsafe-export-", dir=folder)
        except OSError as exc:
            os.close(self._fd)
            raise CrashsafeError(f"cannot write into {folder}: {exc.strerror or exc}") from None
        self._names: list[str] = []

    def draft(self, name: str) -> str:
        """The path to write ``name`` to (in the private folder), published by :meth:`publish`."""
        self._names.append(name)
        return os.path.join(self._scratch, name)

    def publish(self) -> None:
        """fsync every draft, rename each over its target, fsync the destination folder."""
        try:
            scratch = os.open(self._scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                for name in self._names:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=scratch)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                for name in self._names:
                    self._check_target(name)
                    os.rename(name, name, src_dir_fd=scratch, dst_dir_fd=self._fd)
            finally:
                os.close(scratch)
            os.fsync(self._fd)
        except OSError as exc:
            raise CrashsafeError(f"writing {self._folder}: {exc.strerror or exc}") from None

    def _check_target(self, name: str) -> None:
        try:
            mode = os.stat(name, dir_fd=self._fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise CrashsafeError(
                f"{self._folder / name} became {_kind(mode)} while exporting; it was left as it is and "
                "nothing was written there. Remove it and export again"
            )

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self._scratch, ignore_errors=True)  # fd-based: follows no link
            os.close(self._fd)
            self._fd = -1


def _save(tensors: dict[str, np.ndarray[Any, Any]], bf16: set[str], output: str, step: int) -> None:
    """safetensors with the metadata transformers requires (``format: pt``); bfloat16 through torch."""
    from safetensors import SafetensorError

    try:
        _write(tensors, bf16, output, step)
    except (OSError, SafetensorError) as exc:
        raise CrashsafeError(f"writing {output} failed: {exc}") from None


def _write(tensors: dict[str, np.ndarray[Any, Any]], bf16: set[str], output: str, step: int) -> None:
    metadata = {"format": "pt", "crashsafe_step": str(step)}
    if not bf16:
        from safetensors.numpy import save_file

        save_file(tensors, output, metadata=metadata)
        return
    try:
        import torch
        from safetensors.torch import save_file as save_torch
    except ImportError:
        raise CrashsafeError("exporting bfloat16 tensors needs torch; install crashsafe[torch]") from None
    converted = {}
    for name, array in tensors.items():
        t = torch.from_numpy(array)
        converted[name] = t.view(torch.bfloat16) if name in bf16 else t
    save_torch(converted, output, metadata=metadata)
