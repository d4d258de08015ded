"""The reliability soak's own machinery, on a small SQLite run: it strikes, measures, prints and passes.

The soak (``python -m benchmarks soak``) gates releases on what it measures;
this checks that a worker is really killed and replaced, that every task is
accounted for, and that a clean run prints its table and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.backends("sqlite")  # the soak makes its own SQLite database; one session runs it
def test_a_small_soak_kills_a_worker_and_passes(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SA_TASKQUEUE_BENCH_")}
    soak = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "soak",
            "--backends",
            "sqlite",
            "--tasks",
            "2000",
            "--faults",
            "sigkill",
            "--lease",
            "2",
            "--run-timeout",
            "60",
            "--json",
            str(report),
        ],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert soak.returncode == 0, soak.stdout + soak.stderr
    assert "overlapping" in soak.stdout and "left RUNNING" in soak.stdout, soak.stdout
    assert "every run passed" in soak.stdout
    [run] = json.loads(report.read_text())["runs"]
    assert (run["backend"], run["fault"], run["passed"]) == ("sqlite", "sigkill", True)
    assert run["injections"], "the fault struck at least once"
    assert run["worker_restarts"] == len(run["injections"]), "each killed worker was replaced"
    assert run["executions"] >= 2000 and run["lost"] == 0 and run["left_running"] == 0
    assert run["statuses_at_end"] == {"completed": 2000}
