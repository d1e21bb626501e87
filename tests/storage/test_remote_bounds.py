"""Every call to an object store is bounded: an endpoint that accepts connections and never
answers, or one that refuses them, ends in a clear StorageError naming it after a bounded number
of attempts (a real listening socket on 127.0.0.1, a real closed port); what is transient is
decided by the exception's type and the status the store answered, never by message text."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError
from typer.testing import CliRunner

import crashsafe as cs
from crashsafe.cli.app import app
from crashsafe.storage import retry
from crashsafe.storage.bounds import bounded_s3_options
from crashsafe.storage.retry import is_transient, with_retries

from .faultproxy import FaultProxy

runner = CliRunner()


class SilentEndpoint:
    """A listener on 127.0.0.1 that accepts every connection and never answers (a hung proxy, a
    stalled load balancer); it counts the connections it accepted. With ``trickle`` it answers
    each request one byte every 0.05 s, forever: within its headers (``"headers"``), or in a body
    it announced as 1 MB (``"body"``; a HEAD gets 404 at once, so a listing follows). Every read
    then gets a byte well within any read time-out."""

    def __init__(self, trickle: str | None = None) -> None:
        self._trickle = trickle
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.accepted.append(conn)  # held open, never read, never answered
            if self._trickle is not None:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def count(self, expected: int) -> int:
        """The connections accepted, once ``expected`` are (or 10 s went by): a connection the kernel
        completed may reach the accepting thread a while after the client gave up on it."""
        deadline = time.monotonic() + 10
        while len(self.accepted) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.accepted)

    def _answer(self, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nX-Slow: "
        if self._trickle == "body":
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: 1000000\r\n\r\n<"
        with contextlib.suppress(OSError):
            while conn.recv(65536).startswith(b"HEAD") and self._trickle == "body":
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            conn.sendall(head)
            while not self._closed.wait(0.05):
                conn.sendall(b"a" if self._trickle == "headers" else b" ")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


def _options(port: int, **config: Any) -> dict[str, Any]:
    client = {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}
    options: dict[str, Any] = {"key": "k", "secret": "s", "client_kwargs": client}
    if config:
        options["config_kwargs"] = config
    return options


@pytest.mark.timeout(120)
def test_a_silent_endpoint_fails_within_its_bounds_and_names_itself(
    silent: SilentEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener that accepts and never answers held `crashsafe ls` for over 25 minutes (91
    connections): botocore, s3fs and crashsafe each retried inside the other's attempts. Now each
    request has its time-outs and crashsafe's attempts are the only retries: two attempts, two
    connections, and an error that names the endpoint, for a reader, a writer and the CLI. (The
    backoff between attempts is cut to a few ms here: its length is not what this test checks.)"""
    monkeypatch.setattr(retry, "_FIRST_DELAY", 0.005)
    bounds = {"connect_timeout": 0.3, "read_timeout": 0.3, "retries": {"total_max_attempts": 2}}
    options = _options(silent.port, **bounds)
    endpoint = f"127.0.0.1:{silent.port}"
    with pytest.raises(cs.StorageError, match=f"failed 2 times.*{endpoint}|{endpoint}.*failed 2 times"):
        cs.CheckpointManager("s3://bucket/run", storage_options=options, read_only=True)
    assert silent.count(2) == 2  # one request per attempt, no retries inside them
    for command in ("ls", "verify"):
        result = runner.invoke(app, [command, "s3://bucket/run", "--storage-options", json.dumps(options)])
        assert result.exit_code == 2, result.output
        output = " ".join(result.output.split())  # (the error line may be wrapped)
        assert endpoint in output and "does not answer" in output, output
    assert silent.count(6) == 6
    with pytest.raises(cs.StorageError, match=endpoint):
        cs.CheckpointManager("s3://bucket/run", storage_options=options)  # a writer: the same bounds
    assert len(silent.accepted) <= 6 + 2 * 3  # (s3fs asks whether the bucket exists before it creates)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trickle", ["headers", "body"])
def test_an_endpoint_that_trickles_bytes_fails_within_each_attempts_deadline(trickle: str) -> None:
    """A byte every 0.2 s never trips a read time-out, so `crashsafe ls` ran on past 90 s (trickled
    headers) and 60 s (a trickled body). Each attempt now has a deadline, 3 × (connect + read
    time-outs) by default: two attempts, then an error naming the endpoint and the deadline. (Short
    time-outs, a byte every 0.05 s against a read time-out of 0.4 s: the deadline ends each attempt.)"""
    endpoint = SilentEndpoint(trickle)
    try:
        bounds = {"connect_timeout": 0.3, "read_timeout": 0.4, "retries": {"total_max_attempts": 2}}
        options = json.dumps(_options(endpoint.port, **bounds))
        command = [sys.executable, "-m", "crashsafe", "ls", "s3://bucket/run", "--storage-options", options]
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        output = " ".join(done.stderr.split())
        assert done.returncode == 2 and time.monotonic() - started < 30, output
        assert f"127.0.0.1:{endpoint.port}" in output and "failed 2 times" in output, output
        assert "deadline of 2.1 s" in output and "attempt_timeout" in output, output
    finally:
        endpoint.close()


@pytest.mark.timeout(120)
def test_an_attempts_deadline_grows_with_its_bytes(bucket: str, options: dict[str, Any]) -> None:
    """A slow, steady link (2 MiB/s through a proxy): a 4 MiB payload takes 2 s each way, past an
    attempt_timeout of 1 s, and still saves and loads, since its bytes add their time at
    min_throughput. Asking for more throughput than the link has fails the save, committing nothing."""
    proxy = FaultProxy(int(options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1]), rate=2 << 20)
    try:
        proxy.fault("throttle")
        url = f"s3://{bucket}/run"
        client = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
        for throughput, fits in ((1 << 20, True), (64 << 20, False)):
            tries = {"total_max_attempts": 2}
            config = {"attempt_timeout": 1, "min_throughput": throughput, "retries": tries}
            slow = {**options, "client_kwargs": client, "config_kwargs": config}
            with cs.CheckpointManager(url, storage_options=slow, async_save=False, keep_last=None) as mgr:
                step = len(mgr.steps()) + 1
                if fits:
                    mgr.save(step, {"w": np.full(1 << 19, 7.0)})  # 4 MiB
                    assert np.all(mgr.load(step)["w"] == 7.0)
                else:
                    with pytest.raises(cs.StorageError, match="deadline.*not committed"):
                        mgr.save(step, {"w": np.full(1 << 19, 7.0)})
        assert proxy.counts["throttle"] > 0
        assert cs.CheckpointManager(url, storage_options=options, read_only=True).steps() == [1]
    finally:
        proxy.close()


def test_an_unreachable_endpoint_fails_at_once_and_a_read_claims_nothing_of_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused connection took 38 s to fail (retries inside retries), and `ls` and `verify`
    said "Nothing was committed", which means nothing for a read; over ``http://`` they said the
    location "does not exist" (fsspec's HTTP file system calls a refused connection not found).
    Now: crashsafe's five attempts, an error naming the endpoint and saying it refused. (The backoff
    between attempts is cut to a few ms here: its length is not what this test checks.)"""
    monkeypatch.setattr(retry, "_FIRST_DELAY", 0.005)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    options = json.dumps(_options(port))
    s3 = ["s3://bucket/run", "--storage-options", options]
    for command, where in (("ls", s3), ("verify", s3), ("ls", [f"http://127.0.0.1:{port}/run"])):
        result = runner.invoke(app, [command, *where])
        assert result.exit_code == 2, result.output
        output = " ".join(result.output.split())  # (the error line may be wrapped)
        assert f"127.0.0.1:{port}" in output and "failed 5 times" in output, output
        assert "refused the connection" in output and "does not exist" not in output, output
        assert "committed" not in output, output


@pytest.fixture
def credentials_trickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SilentEndpoint]:
    """No credentials but a container credentials endpoint on 127.0.0.1 that trickles its headers
    (a hung ECS/EKS credentials agent): botocore's 2 s read time-out for it never trips."""
    endpoint = SilentEndpoint("headers")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{endpoint.port}/credentials")
    try:
        yield endpoint
    finally:
        endpoint.close()


def _without_keys(options: dict[str, Any], **config: Any) -> dict[str, Any]:
    """``options`` whose credentials are looked up by botocore, bounded by ``config``."""
    found = {k: v for k, v in options.items() if k not in ("key", "secret")}
    return {**found, "config_kwargs": config}


@pytest.mark.timeout(60)
def test_a_credential_lookup_that_never_ends_fails_within_the_attempts_deadline(
    credentials_trickle: SilentEndpoint, options: dict[str, Any]
) -> None:
    """Making the S3 client looks its credentials up (a credential_process, a container or instance
    metadata endpoint): made in the store's constructor with no deadline, it held a reader, the CLI
    and a writer forever. It has an attempt's deadline of its own, outside any request's."""
    bounded = _without_keys(options, attempt_timeout=1, retries={"total_max_attempts": 2})
    endpoint = options["client_kwargs"]["endpoint_url"].removeprefix("http://")
    started = time.monotonic()
    with pytest.raises(cs.StorageError, match=f"making the S3 client.*{endpoint}.*failed 2 times.*deadline"):
        cs.CheckpointManager("s3://bucket/run", storage_options=bounded, read_only=True)
    result = runner.invoke(app, ["ls", "s3://bucket/run", "--storage-options", json.dumps(bounded)])
    assert result.exit_code == 2 and endpoint in " ".join(result.output.split()), result.output
    assert time.monotonic() - started < 30
    assert credentials_trickle.count(4) == 4  # the lookup was tried, once an attempt


@pytest.mark.timeout(60)
def test_a_mirror_whose_credentials_do_not_come_never_stops_training(
    tmp_path: Path, bucket: str, options: dict[str, Any], credentials_trickle: SilentEndpoint
) -> None:
    """A mirror that does not answer when the manager opens is opened without a request and left
    for later; opening it again made its client (its credentials looked up), so a credentials
    agent that did not answer hung the manager's open. It opens with a MirrorWarning and saves."""
    bounded = _without_keys(options, attempt_timeout=1, retries={"total_max_attempts": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mirror = f"s3://{bucket}/run"
        with cs.CheckpointManager(tmp_path / "local", mirror=mirror, storage_options=bounded) as mgr:
            mgr.save(1, {"w": np.arange(4.0)})
            mgr.wait()
    said = [str(w.message) for w in caught if issubclass(w.category, cs.MirrorWarning)]
    assert any("cannot be reached" in m and "Training goes on without it" in m for m in said), said
    assert cs.CheckpointManager(tmp_path / "local", read_only=True).steps() == [1]


def test_options_the_s3_client_refuses_fail_naming_the_endpoint_and_what_to_check() -> None:
    """Options that botocore refuses as the client is made (an unknown config key, a malformed
    endpoint_url, a missing profile) said only botocore's words: the error names the endpoint and
    the options to check, at once (no retries), for the API and the CLI."""
    client = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}
    bad_ones: list[dict[str, Any]] = [
        {"key": "k", "secret": "s", "client_kwargs": client, "config_kwargs": {"no_such_option": 1}},
        {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://[::1"}},
        {"profile": "no-such-profile", "client_kwargs": client},
    ]
    for bad in bad_ones:
        where = bad["client_kwargs"]["endpoint_url"]
        with pytest.raises(cs.StorageError, match=r"making the S3 client") as caught:
            cs.CheckpointManager("s3://bucket/run", storage_options=bad, read_only=True)
        message = str(caught.value)
        assert where in message and "failed once" not in message, message
        assert "Check storage_options" in message and "nothing was read or written" in message, message
    options = json.dumps(bad_ones[0])
    result = runner.invoke(app, ["ls", "s3://bucket/run", "--storage-options", options])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "Check storage_options" in output, result.output


def test_the_bounds_are_botocores_own_options_and_refuse_no_bound() -> None:
    """Time-outs and attempts are botocore's ``config_kwargs``; crashsafe does the retrying (one
    request per attempt); a time-out that is not a positive number is refused (no bound)."""
    config = {"read_timeout": 2, "retries": {"max_attempts": 2}}  # 2 retries: 3 attempts
    options, bounds = bounded_s3_options({"config_kwargs": config})
    assert (bounds.attempts, bounds.connect_timeout, bounds.read_timeout) == (3, 5.0, 2.0)
    assert options["config_kwargs"]["retries"] == {"total_max_attempts": 1}
    assert bounded_s3_options({})[1].attempts == 5
    assert bounded_s3_options({})[1].deadline() == 60  # 3 × (5 + 15) s
    assert bounded_s3_options({})[1].deadline(1 << 30) == 60 + 8192  # 1 GiB at 128 KiB/s
    ours = {"attempt_timeout": 9, "min_throughput": 1000}  # crashsafe's: botocore would refuse them
    options, bounds = bounded_s3_options({"config_kwargs": ours})
    assert bounds.deadline(500) == 9.5 and not set(ours) & set(options["config_kwargs"])
    bad_ones = ({"read_timeout": None}, {"connect_timeout": 0}, {"retries": {"total_max_attempts": 0}})
    for bad in (*bad_ones, {"attempt_timeout": float("inf")}, {"min_throughput": -1}):
        with pytest.raises(cs.StorageError, match="config_kwargs"):
            cs.CheckpointManager("s3://bucket/run", storage_options={"config_kwargs": bad}, read_only=True)


def _client_error(status: int, code: str) -> ClientError:
    """botocore's own error for an S3 answer with ``status`` and error ``code``."""
    response: Any = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "GetObject")


def _translated(error: ClientError) -> OSError:
    """The error as s3fs raises it: an OSError raised from botocore's."""
    wrapped = OSError(5, "translated")
    wrapped.__cause__ = error
    return wrapped


def test_transience_is_decided_by_type_and_status_not_text() -> None:
    """A ValueError naming ``step_000000000500`` counted as transient (its text held "500") and was
    tried four times; a 503 counts by its status, a 404 or 403 never."""
    calls: list[int] = []

    def naming_a_step() -> None:
        calls.append(1)
        raise ValueError("bad shard step_000000000500/data-1.bin: Timeout reading header, 503")

    with pytest.raises(cs.StorageError, match="step_000000000500"):
        with_retries(naming_a_step, "reading a step")
    assert len(calls) == 1  # not retried
    assert is_transient(_translated(_client_error(503, "SlowDown")))
    assert is_transient(_translated(_client_error(500, "InternalError")))
    assert is_transient(_client_error(400, "RequestTimeout"))  # S3's slow-body answer
    assert not is_transient(_translated(_client_error(403, "AccessDenied 503 Timeout")))
    assert not is_transient(_translated(_client_error(404, "NoSuchBucket")))
    assert is_transient(ConnectionResetError())
    assert not is_transient(RuntimeError("Connection reset by peer"))  # text says nothing


def test_fsspec_is_a_core_dependency() -> None:
    """Every URL location (``file://``, ``memory://``, ``s3://``) imports fsspec, but only the s3
    extra installed it: ``pip install crashsafe`` then failed on ``file://`` with an ImportError."""
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0] for requirement in project["dependencies"]]
    assert "fsspec" in names
