"""The S3 lease against writers that share a hostname but not a PID space: a writer in another PID
namespace (a container on a host-network pod, `unshare --pid`) or on another machine of that name
sees no process with the holder's pid. It took the live lease at once, its cleanup removed the
holder's shards mid-save, and the holder then committed a step missing a data file. Now "the holder
is dead here" needs this boot and this PID namespace too, and a commit reads the lease first."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import s3fs

import crashsafe as cs
from crashsafe.format.manifest import Manifest
from crashsafe.storage.objectstore import FsspecStore
from crashsafe.storage.writer import StepWriter

from .test_object_store import _entry, _tree

_TAKE = """
import json, sys, time
from crashsafe.errors import LockedError
from crashsafe.storage.objectstore import FsspecStore
started = time.monotonic()
try:
    FsspecStore(sys.argv[1], json.loads(sys.argv[2]), lease_seconds=2.0).lock()
    print("took the lease after", round(time.monotonic() - started, 1), "s")
except LockedError as exc:
    print("LockedError:", exc)
"""


def _here() -> dict[str, str]:
    """This process's boot id and PID namespace, as a lease records them ({} if not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return {"boot": boot, "pidns": str(os.stat("/proc/self/ns/pid").st_ino)}
    except OSError:
        return {}


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def _dead_pid() -> int:
    """The pid of a process of this namespace that ran and was reaped (no longer runs)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _lease(fs: s3fs.S3FileSystem, path: str, expires: float, **body: Any) -> None:
    holder = f"{socket.gethostname()}:{_dead_pid()}:old"
    fs.pipe_file(path, json.dumps({"holder": holder, "expires": expires, **body}).encode())


@pytest.mark.timeout(120)
def test_a_writer_in_another_pid_namespace_waits_for_a_live_lease(
    bucket: str, options: dict[str, Any]
) -> None:
    """A real `unshare --pid` writer of the same hostname: the holder's pid is no process there.
    It took the lease at once; now it watches the lease, sees it renewed, and is refused."""
    if not _unshare_works():
        pytest.skip(
            "needs `unshare --pid` (root or unprivileged user namespaces), which this machine refuses; "
            "the simulated-namespace cases in this file still run"
        )
    url = f"s3://{bucket}/run"
    holder = FsspecStore(url, options, lease_seconds=2.0).lock()
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(cs.__file__).parents[1])}  # this crashsafe
        command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _TAKE]
        done = subprocess.run([*command, url, json.dumps(options)], capture_output=True, text=True, env=env)
        assert "keeps renewing its lease" in done.stdout, (done.stdout, done.stderr[-2000:])
        holder.check()
    finally:
        holder.release()


@pytest.mark.parametrize("whose", ["an older writer", "another pid namespace", "another boot"])
def test_a_lease_of_this_hostname_is_waited_out_unless_its_namespace_and_boot_are_ours(
    bucket: str, options: dict[str, Any], whose: str
) -> None:
    """A lease naming this hostname and a pid that runs nowhere here, but not this boot and PID
    namespace (or naming neither, as crashsafe's earlier leases): it may be alive elsewhere, so it
    is taken only once it expired."""
    url = f"s3://{bucket}/run"
    here = _here()
    body = {
        "an older writer": {},
        "another pid namespace": {**here, "pidns": "1"},
        "another boot": {**here, "boot": "00000000-0000-0000-0000-000000000000"},
    }[whose]
    expires = time.time() + 2.0
    _lease(s3fs.S3FileSystem(**options), f"{bucket}/run/.lock", expires, **body)
    lease = FsspecStore(url, options, lease_seconds=2.0).lock()
    taken = time.time()
    lease.release()
    assert taken >= expires


def test_a_lease_of_a_dead_process_of_this_namespace_and_boot_is_taken_at_once(
    bucket: str, options: dict[str, Any]
) -> None:
    """A job restarted on its machine after a SIGKILL does not wait out its own dead lease."""
    if not _here():
        pytest.skip(
            "needs Linux's /proc boot id and PID namespace, absent here: without them every lease "
            "is waited out, so there is no immediate takeover to test"
        )
    url = f"s3://{bucket}/run"
    _lease(s3fs.S3FileSystem(**options), f"{bucket}/run/.lock", time.time() + 60, **_here())
    started = time.monotonic()
    FsspecStore(url, options, lease_seconds=30.0).lock().release()
    assert time.monotonic() - started < 10


def test_a_writer_whose_lease_was_taken_since_its_last_renewal_commits_and_deletes_nothing(
    bucket: str, options: dict[str, Any]
) -> None:
    """Another writer took the lease after this one's last renewal (renewals are 10 s apart). The
    commit checked only what the renewer had seen, so it committed beside that writer; now it reads
    the lease object right before the manifest and each deletion."""
    url = f"s3://{bucket}/run"
    store = FsspecStore(url, options, lease_seconds=30.0)
    lease = store.lock()
    done = FsspecStore(url, options)
    first = StepWriter(store, 1)
    first.commit(Manifest(1, time.time(), _tree(), (_entry(first, "w", np.ones(10)),), first.files()))
    writer = StepWriter(store, 2)
    entry = _entry(writer, "w", np.ones(1000))
    other = json.dumps({"holder": "other-host:1:y", "expires": time.time() + 60}).encode()
    s3fs.S3FileSystem(**options).pipe_file(f"{bucket}/run/.lock", other)  # the takeover
    with pytest.raises(cs.LockedError, match="another writer took over"):
        writer.commit(Manifest(2, time.time(), _tree(), (entry,), writer.files()))
    with pytest.raises(cs.LockedError, match="another writer took over"):
        store.delete(1)
    assert done.steps() == [1]
    lease.release()
    assert s3fs.S3FileSystem(**options).cat_file(f"{bucket}/run/.lock") == other  # left to its holder
