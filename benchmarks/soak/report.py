"""The soak's table, one row per backend and fault, and the lines that explain a failed row."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from benchmarks.soak.results import RunResult

COLUMNS = (
    "backend",
    "fault",
    "isolation",
    "tasks",
    "strikes",
    "executions",
    "re-runs",
    "overlapping",
    "stale starts",
    "lost",
    "left RUNNING",
    "failed",
    "stall s",
    "recover s",
    "run s",
    "verdict",
)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def shouted(count: int) -> str:
    """A count that fails the run is shown in bold red, so it is not read past."""
    return f"[bold red]{count}[/bold red]" if count else "0"


def soak_table(results: list[RunResult], title: str) -> Table:
    table = Table(title=title)
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("backend", "fault", "isolation") else "right")
    for result in results:
        if result.skipped:
            table.add_row(
                result.backend, result.fault, result.isolation, *("" for _ in COLUMNS[3:-1]), "skipped"
            )
            continue
        recover = seconds(result.recover)
        if result.injections and any(i.recovered is None for i in result.injections):
            recover = "[bold red]never[/bold red]"
        table.add_row(
            result.backend,
            result.fault,
            result.isolation,
            f"{result.tasks:,}",
            f"{len(result.injections)}/{result.injections_wanted}",
            f"{result.executions:,}",
            f"{result.reruns:,}",
            shouted(result.overlapping),
            str(result.stale_starts),
            shouted(result.lost),
            shouted(result.left_running),
            str(result.failed),
            seconds(result.stall),
            recover,
            f"{result.seconds:.0f}",
            "[bold red]FAIL[/bold red]" if result.problems else "pass",
        )
    return table


def print_report(console: Console, results: list[RunResult], title: str) -> None:
    """The table, then a line per skipped run and per failed run saying why, and where its files are."""
    console.print(soak_table(results, title))
    for result in results:
        where = f"{result.backend}/{result.fault}"
        if result.skipped:
            console.print(f"{where}: skipped: {result.skipped}", markup=False, highlight=False)
        elif result.problems:
            console.print(f"{where}: FAIL: {'; '.join(result.problems)}", markup=False, highlight=False)
        if result.unexpected_exits and not result.skipped:
            exits = "; ".join(result.unexpected_exits)
            console.print(f"{where}: note: restarted after exiting: {exits}", markup=False, highlight=False)
        if result.problems and result.directory:
            console.print(f"{where}: logs kept in {result.directory}", markup=False, highlight=False)
