"""``crashsafe ps ...``: the parameter server with FreeLauncher recovery, live.

Imports of Ray and the parameter server happen inside the commands, so ``crashsafe --help``
stays fast. What Ray itself says (its notices, its report on the server the demo kills on purpose)
goes to a log file the demo names, not to the terminal.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from crashsafe.ps import Failure, PSConfig, PSJob, RunResult

app = typer.Typer(
    name="ps",
    help="Parameter server on Ray with FreeLauncher replication (lossless server recovery).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


@app.callback()
def _group() -> None:
    """Parameter-server commands."""


def _train(job: PSJob, config: PSConfig, title: str, failures: list[Failure], console: Console) -> RunResult:
    """Run the job with a live progress bar; print each recovery as it completes.

    The bar leaves ``sys.stdout`` alone: during the run it is Ray's log file (:func:`ray_messages_to`).
    """
    with Progress(
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("clocks  loss {task.fields[loss]}  {task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        redirect_stdout=False,
    ) as progress:
        task = progress.add_task(title, total=config.clocks, loss="-", note="")
        seen = 0

        def on_clock(clock: int, result: RunResult) -> None:
            nonlocal seen
            for event in result.recoveries[seen:]:
                who = ", ".join(
                    [f"server {s}" for s in event.servers] + [f"worker {w}" for w in event.workers]
                )
                progress.console.print(
                    f"  [yellow]failure[/] of {who} before clock {event.clock}: "
                    f"recovered by [bold]{event.kind}[/] in {event.seconds:.2f} s "
                    f"(replacement {event.replace_seconds:.2f} s), "
                    f"{event.replayed_pushes} retained pushes replayed, "
                    f"{event.recomputed_clocks} clocks recomputed"
                )
            seen = len(result.recoveries)
            progress.update(task, completed=clock + 1, note=f"{seen} recoveries" if seen else "")

        job.on_clock = on_clock
        result = job.run(failures, config=config)
        progress.update(task, loss=f"{result.losses[-1]:.4f}" if result.losses else "-")
    return result


@app.command("demo")
def demo_cmd(
    servers: Annotated[int, typer.Option(help="parameter servers (key-range shards)")] = 2,
    workers: Annotated[int, typer.Option(help="workers")] = 4,
    replicas: Annotated[int, typer.Option(help="k: copies of every block; tolerates k-1 failures")] = 2,
    kill_server_at: Annotated[int, typer.Option(help="clock after which servers are killed")] = 50,
    kill_servers: Annotated[int, typer.Option(help="how many servers to kill at once")] = 1,
    spares: Annotated[int, typer.Option(help="standby servers ready to take over a dead one's shard")] = 1,
    how: Annotated[
        str, typer.Option(help="kill with 'ray' (ray.kill) or 'sigkill' (the process)")
    ] = "sigkill",
    clocks: Annotated[int, typer.Option(help="training clocks")] = 100,
    workload: Annotated[str, typer.Option(help="sparse_lr, mf or digits")] = "sparse_lr",
    consistency: Annotated[str, typer.Option(help="bsp or ssp")] = "bsp",
    optimizer: Annotated[str, typer.Option(help="sgd, adagrad or adam (server side)")] = "adagrad",
    compare: Annotated[bool, typer.Option(help="also train without failure and compare bit for bit")] = True,
    address: Annotated[
        str | None, typer.Option(help="existing Ray cluster (default: local, 127.0.0.1)")
    ] = None,
) -> None:
    """Train on Ray, kill parameter servers mid-run, recover them from workers' copies, and show
    that no update was lost (and, under BSP, that the model is bit-identical to a clean run).

    Ray's own messages go to ray.log in a new temporary directory, which also holds the session
    files of a Ray the demo starts; the demo prints where. It writes no checkpoints."""
    from crashsafe.errors import CrashsafeError
    from crashsafe.ps import Failure, PSConfig, PSJob, ray_messages_to

    try:
        settings: dict[str, Any] = {"consistency": consistency, "optimizer": optimizer}  # checked by PSConfig
        config = PSConfig(
            workload=workload,
            servers=servers,
            workers=workers,
            replicas=replicas,
            clocks=clocks,
            spares=spares,
            **settings,
        )
        if not 0 <= kill_server_at < clocks:
            raise typer.BadParameter(f"--kill-server-at must be in [0, {clocks - 1}] (the clocks run)")
        if not 0 <= kill_servers <= servers:
            raise typer.BadParameter(f"--kill-servers must be between 0 and --servers ({servers})")
        failures = (
            [Failure(clock=kill_server_at, servers=tuple(range(kill_servers)), how=cast(Any, how))]
            if kill_servers
            else []
        )
    except CrashsafeError as exc:
        err.print(Text.assemble(("error:", "bold red"), f" {exc}"))
        raise typer.Exit(2) from None
    console = Console(file=sys.stdout)  # the terminal, also while sys.stdout is Ray's log file
    work = Path(tempfile.mkdtemp(prefix="cs-ps-"))  # short: Ray's socket paths must fit in 107 bytes
    log = work / "ray.log"
    console.print(
        f"starting Ray and {servers} servers + {workers} workers ({workload}, {consistency}, k={replicas})"
    )
    console.print(f"files in {work}:", soft_wrap=True)
    console.print(f"  {log.name}  Ray's own messages (its notices, its report on each killed server)")
    with ray_messages_to(log), PSJob(config, address=address, temp_dir=str(work)) as job:
        for session in sorted(work.glob("session_2*")):  # there if the demo started Ray
            console.print(f"  {session.name}/  Ray's session files and its processes' logs", soft_wrap=True)
        console.print("  no checkpoints: a killed server's shard is rebuilt from the workers' copies")
        reference = _train(job, config, "failure-free", [], console) if compare else None
        result = _train(job, config, "with failures", failures, console)
    identical = reference is not None and all(
        reference.params[name].tobytes() == result.params[name].tobytes() for name in result.params
    )
    _summary(console, result, reference, identical)
    console.print(f"Ray's messages: {log}", soft_wrap=True)
    ok = result.updates_lost == 0 and (reference is None or consistency == "ssp" or identical)
    if not ok:
        raise typer.Exit(1)


def _summary(console: Console, result: RunResult, reference: RunResult | None, identical: bool) -> None:
    from crashsafe.cli._common import human_bytes

    table = Table(title="parameter server: run with failures")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("clocks", str(result.clocks)),
        ("throughput", f"{result.clocks_per_second:.1f} clocks/s"),
        ("updates pushed / applied", f"{result.updates_pushed} / {result.updates_applied}"),
        ("updates lost", f"[bold]{result.updates_lost}"),
        ("clocks recomputed", str(result.recomputed_clocks)),
        ("recoveries", ", ".join(f"{r.kind} {r.seconds:.2f}s" for r in result.recoveries) or "none"),
        ("replication bytes / clock", human_bytes(result.replication_bytes_per_clock)),
        ("final " + ", ".join(result.metrics), ", ".join(f"{v:.4f}" for v in result.metrics.values())),
    ]
    if reference is not None:
        rows.append(("identical to failure-free run", "[green]yes" if identical else "[red]no"))
        rows.append(("failure-free throughput", f"{reference.clocks_per_second:.1f} clocks/s"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
