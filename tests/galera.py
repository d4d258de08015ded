"""A real 3-node MariaDB Galera cluster on this machine's loopback, for the tests and benchmarks.

Debian's packages are what runs: ``mariadbd`` (MariaDB 10.11) with the
``galera-4`` provider (``/usr/lib/galera/libgalera_smm.so``) and ``rsync``
for state transfers (``.ci/install-galera`` installs what is missing).  Each
node has its own data directory under one temporary directory, and its
client, replication, incremental-transfer and state-transfer ports are free
loopback ports chosen at start, so several clusters can run on one machine.

MariaDB's rsync state transfer cannot write as root: run as root, the nodes
run as the unprivileged account ``sa_taskqueue_galera`` (created on first
use; ``.ci/run`` creates it beforehand).  The first node is initialised,
bootstrapped once to give the cluster its identity, and shut down cleanly;
the joiners start from a copy of its data directory, so they join by an
incremental transfer (nothing to send) rather than a full one.

    with galera_cluster() as cluster:
        cluster.urls        # one mariadb+pymysql:// URL per node, database "test"
        cluster.kill(1)     # SIGKILL node 1 (indexes are into .urls)
        cluster.start(1)    # start it again: it rejoins by IST; returns once Synced

``python -m tests.galera start`` starts one for benchmarks and hand runs and
prints its URLs (``--state FILE`` says where it records the processes);
``python -m tests.galera stop`` stops it and removes its directory.

Nothing is left behind: the block's end stops every node and removes the
directory, whatever ended it; a watchdog process does the same if the
process that started the cluster dies without that (a SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

#: Debian's server, provider and initialiser.
MARIADBD = "/usr/sbin/mariadbd"
PROVIDER = "/usr/lib/galera/libgalera_smm.so"
INSTALL_DB = "mariadb-install-db"

#: The unprivileged account the nodes run as when the tests run as root.
ACCOUNT = "sa_taskqueue_galera"
NOLOGIN = "/usr/sbin/nologin"

#: The database every node's URL names (created on node 0, replicated).
DATABASE = "test"

#: Bounded waits on a busy 2-core machine.
START_TIMEOUT = 180.0
STOP_TIMEOUT = 60.0
RECOVER_TIMEOUT = 60.0

#: Where ``python -m tests.galera start`` records a cluster unless told.
DEFAULT_STATE = Path(tempfile.gettempdir()) / "sa_taskqueue_galera.json"


class GaleraUnavailable(RuntimeError):
    """The cluster could not be started; the message says why (with the node's log)."""


@dataclass
class Node:
    """One ``mariadbd`` of the cluster: its directory and its four loopback ports."""

    index: int
    directory: Path
    port: int
    gcomm_port: int
    ist_port: int
    sst_port: int
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log(self) -> Path:
        return self.directory / "error.log"

    @property
    def config(self) -> Path:
        return self.directory / "my.cnf"

    @property
    def url(self) -> str:
        return f"mariadb+pymysql://root@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def admin_url(self) -> str:
        return f"mariadb+pymysql://root@127.0.0.1:{self.port}/"


@dataclass
class GaleraCluster:
    """A running cluster; ``urls[i]`` reaches node ``i``."""

    workdir: Path
    nodes: list[Node]
    account: tuple[int, int] | None
    watchdog: subprocess.Popen[bytes] | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def urls(self) -> list[str]:
        """One ``mariadb+pymysql://root@127.0.0.1:PORT/test`` per node, in node order."""
        return [node.url for node in self.nodes]

    def alive(self, node: int) -> bool:
        return _alive(self.nodes[node].pid)

    def kill(self, node: int) -> None:
        """SIGKILL node ``node``'s server (no shutdown: the crash a power cut would be)."""
        target = self.nodes[node]
        if target.pid is not None and _alive(target.pid):
            os.kill(target.pid, signal.SIGKILL)
            _reap(target, timeout=STOP_TIMEOUT)

    def start(self, node: int, timeout: float = START_TIMEOUT) -> None:
        """Start node ``node`` again: it recovers its position and rejoins by IST; returns once Synced."""
        target = self.nodes[node]
        if target.pid is not None and _alive(target.pid):
            raise GaleraUnavailable(f"node {node} is running already (pid {target.pid})")
        _launch(target, self.account, bootstrap=False, position=_recover(target, self.account))
        _wait_synced(target, len(self.nodes), timeout)

    def stop_node(self, node: int) -> None:
        """Shut node ``node`` down cleanly (SIGTERM): it leaves the cluster and saves its position."""
        _terminate(self.nodes[node])

    def stop(self) -> None:
        """Stop every node and remove the directory; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        for node in reversed(self.nodes):
            _terminate(node)
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def state(self) -> dict[str, Any]:
        """What ``python -m tests.galera stop`` needs to find and stop this cluster."""
        return {
            "workdir": str(self.workdir),
            "urls": self.urls,
            "pids": [node.pid for node in self.nodes],
        }


@contextmanager
def galera_cluster(nodes: int = 3) -> Iterator[GaleraCluster]:
    """Start a synced cluster of ``nodes`` nodes; stop it and remove its files when the block ends."""
    cluster = start_cluster(nodes, watch=True)
    try:
        yield cluster
    finally:
        cluster.stop()


#: Whole starts tried when a port chosen free was taken before a node bound it (another cluster's).
START_ATTEMPTS = 3


def start_cluster(nodes: int = 3, *, watch: bool = True) -> GaleraCluster:
    """Start a cluster (the caller stops it); ``watch`` adds the watchdog that stops it if we die."""
    if nodes < 1:
        raise ValueError(f"a cluster needs at least one node, not {nodes}")
    _check_installed()
    account = _account()
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_cluster(nodes, account, watch=watch)
        except GaleraUnavailable as error:
            if attempt == START_ATTEMPTS or "already in use" not in str(error):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _start_cluster(nodes: int, account: tuple[int, int] | None, *, watch: bool) -> GaleraCluster:
    workdir = Path(tempfile.mkdtemp(prefix="sa_taskqueue_galera_"))
    workdir.chmod(0o755)
    cluster = GaleraCluster(workdir, [], account)
    try:
        if watch:
            cluster.watchdog = _start_watchdog(workdir)
        ports = _free_ports(4 * nodes)
        for index in range(nodes):
            directory = workdir / f"node{index}"
            directory.mkdir()
            port, gcomm_port, ist_port, sst_port = ports[4 * index : 4 * index + 4]
            node = Node(index, directory, port, gcomm_port, ist_port, sst_port)
            cluster.nodes.append(node)
        for node in cluster.nodes:
            node.config.write_text(_config(node, cluster.nodes))
        _chown_tree(workdir, account)
        first = cluster.nodes[0]
        _install_db(first, account)
        # Bootstrap once to give the cluster its identity (grastate.dat), then
        # shut down cleanly: its data directory, copied, lets each joiner
        # start at the same position and join by IST with nothing to send.
        _launch(first, account, bootstrap=True)
        _wait_synced(first, 1, START_TIMEOUT)
        _create_database(first)
        _terminate(first)
        for node in cluster.nodes[1:]:
            shutil.copytree(first.data, node.data, symlinks=True)
            _chown_tree(node.data, account)
        _launch(first, account, bootstrap=True)
        _wait_synced(first, 1, START_TIMEOUT)
        for node in cluster.nodes[1:]:
            _launch(node, account, bootstrap=False)
            _wait_synced(node, node.index + 1, START_TIMEOUT)
        return cluster
    except BaseException:
        cluster.stop()
        raise


# Configuration ---------------------------------------------------------------------------


def _config(node: Node, nodes: list[Node]) -> str:
    members = ",".join(f"127.0.0.1:{other.gcomm_port}" for other in nodes)
    provider_options = ";".join(
        [
            f"gmcast.listen_addr=tcp://127.0.0.1:{node.gcomm_port}",
            f"ist.recv_addr=127.0.0.1:{node.ist_port}",
            "gcache.size=64M",
            "pc.wait_prim_timeout=PT60S",
            # On a busy 2-core machine a node can stall for seconds; the defaults (a peer suspected
            # after 5 s, dropped after 15 s) then split the cluster into non-primary parts.
            "evs.suspect_timeout=PT10S",
            "evs.inactive_timeout=PT30S",
            "evs.install_timeout=PT15S",
        ]
    )
    settings = {
        "datadir": node.data,
        "socket": node.directory / "mysqld.sock",
        "pid-file": node.directory / "mysqld.pid",
        "log-error": node.log,
        "tmpdir": node.directory,
        "port": node.port,
        "bind-address": "127.0.0.1",
        "skip-name-resolve": "ON",
        "max_connections": 400,
        "performance_schema": "OFF",
        "default_storage_engine": "InnoDB",
        "innodb_buffer_pool_size": "64M",
        "innodb_log_file_size": "48M",
        "innodb_flush_log_at_trx_commit": 0,
        "innodb_doublewrite": 0,
        "innodb_autoinc_lock_mode": 2,
        "binlog_format": "ROW",
        "wsrep_on": "ON",
        "wsrep_provider": PROVIDER,
        "wsrep_provider_options": f'"{provider_options}"',
        "wsrep_cluster_name": "sa_taskqueue",
        "wsrep_cluster_address": f"gcomm://{members}",
        "wsrep_node_name": f"node{node.index}",
        "wsrep_node_address": f"127.0.0.1:{node.gcomm_port}",
        "wsrep_node_incoming_address": f"127.0.0.1:{node.port}",
        "wsrep_sst_method": "rsync",
        "wsrep_sst_receive_address": f"127.0.0.1:{node.sst_port}",
        "wsrep_slave_threads": 2,
    }
    lines = ["[mysqld]", *(f"{key} = {value}" for key, value in settings.items())]
    return "\n".join(lines) + "\n"


# Processes -------------------------------------------------------------------------------


def _check_installed() -> None:
    missing = [path for path in (MARIADBD, PROVIDER) if not os.path.exists(path)]
    if shutil.which("rsync") is None:
        missing.append("rsync")
    if shutil.which(INSTALL_DB) is None:
        missing.append(INSTALL_DB)
    if missing:
        raise GaleraUnavailable(
            "the Galera cluster needs Debian's mariadb-server, galera-4 and rsync; "
            f"missing: {', '.join(missing)} (sh .ci/install-galera, as root)"
        )


def _account() -> tuple[int, int] | None:
    """The (uid, gid) the nodes run as, or None to run them as ourselves (not root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    failure = ""
    for _ in range(20):
        try:
            entry = pwd.getpwnam(ACCOUNT)
            return entry.pw_uid, entry.pw_gid
        except KeyError:
            pass
        # Another run may be adding it at this very moment: look again.
        added = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", NOLOGIN, ACCOUNT],
            capture_output=True,
            text=True,
            check=False,
        )
        failure = added.stderr.strip()
        if added.returncode != 0:
            time.sleep(0.5)
    raise GaleraUnavailable(f"the nodes do not run as root, and adding user {ACCOUNT} failed: {failure}")


def _as_account(account: tuple[int, int] | None) -> dict[str, Any]:
    if account is None:
        return {}
    return {"user": account[0], "group": account[1], "extra_groups": []}


def _chown_tree(root: Path, account: tuple[int, int] | None) -> None:
    if account is None:
        return
    os.chown(root, *account)
    for parent, directories, files in os.walk(root):
        for name in directories + files:
            os.lchown(os.path.join(parent, name), *account)


def _install_db(node: Node, account: tuple[int, int] | None) -> None:
    node.data.mkdir(mode=0o700)
    _chown_tree(node.data, account)
    done = subprocess.run(
        [
            INSTALL_DB,
            "--no-defaults",
            f"--datadir={node.data}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            "--innodb-log-file-size=48M",
        ],
        cwd=node.directory,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        **_as_account(account),
    )
    if done.returncode != 0:
        raise GaleraUnavailable(f"{INSTALL_DB} failed: {done.stdout}{done.stderr}")


def _recover(node: Node, account: tuple[int, int] | None) -> str | None:
    """The position a crashed node's InnoDB holds (``uuid:seqno``), as ``mysqld_safe`` finds it.

    After a SIGKILL, grastate.dat says seqno -1; started without the
    position, the node would ask for a full state transfer.  With it (passed
    as ``--wsrep-start-position``), a donor sends the missed writesets (IST).
    """
    log = node.directory / "recover.log"
    command = [
        MARIADBD,
        f"--defaults-file={node.config}",
        "--wsrep-recover",
        f"--log-error={log}",
        # Nothing to serve: no port to bind (the killed server's may linger), a socket of its own.
        "--skip-networking",
        f"--socket={node.directory / 'recover.sock'}",
    ]
    # The position is logged as soon as InnoDB has recovered; the process may
    # then spin on (MariaDB 10.11 can, over a table's .frm after a crash), so
    # it is stopped once the line is there.
    marker = "WSREP: Recovered position: "
    process = subprocess.Popen(
        command,
        cwd=node.directory,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **_as_account(account),
    )
    deadline = time.monotonic() + RECOVER_TIMEOUT
    output = ""
    try:
        while process.poll() is None:
            if log.exists() and marker in log.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                # Without the position the node still rejoins, by a full transfer (rsync) instead.
                output = f"--wsrep-recover did not finish within {RECOVER_TIMEOUT:.0f} s"
                break
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    text = (log.read_text(errors="replace") if log.exists() else "") + output
    for line in reversed(text.splitlines()):
        if marker in line:
            position = line.split(marker, 1)[1].strip()
            return None if position.endswith(":-1") else position
    return None


def _launch(
    node: Node, account: tuple[int, int] | None, *, bootstrap: bool, position: str | None = None
) -> None:
    command = [MARIADBD, f"--defaults-file={node.config}"]
    if bootstrap:
        command.append("--wsrep-new-cluster")
    if position is not None:
        command.append(f"--wsrep-start-position={position}")
    with (node.directory / "stdout.log").open("ab") as output:
        node.process = subprocess.Popen(
            command,
            cwd=node.directory,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches the tests, which then stop it
            **_as_account(account),
        )
    node.pid = node.process.pid


def _status(conn: sa.Connection) -> dict[str, str]:
    rows = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'wsrep_%%'").all()
    return {str(name): str(value) for name, value in rows}


def _wait_synced(node: Node, cluster_size: int, timeout: float) -> None:
    """Poll until the node is ready, Synced, and sees ``cluster_size`` members; fail with its log."""
    engine = sa.create_engine(node.admin_url, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 3})
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    try:
        while time.monotonic() < deadline:
            if node.process is not None and node.process.poll() is not None:
                raise GaleraUnavailable(
                    f"node {node.index} exited with {node.process.returncode}; its log:\n{_tail(node.log)}"
                )
            try:
                with engine.connect() as conn:
                    seen = _status(conn)
            except sa.exc.DBAPIError:
                seen = {}
            if (
                seen.get("wsrep_ready") == "ON"
                and seen.get("wsrep_local_state_comment") == "Synced"
                and int(seen.get("wsrep_cluster_size", "0")) >= cluster_size
            ):
                return
            time.sleep(0.2)
    finally:
        engine.dispose()
    state = {key: seen.get(key) for key in ("wsrep_ready", "wsrep_local_state_comment", "wsrep_cluster_size")}
    raise GaleraUnavailable(
        f"node {node.index} was not Synced within {timeout:.0f} s ({state}); its log:\n{_tail(node.log)}"
    )


def _create_database(node: Node) -> None:
    engine = sa.create_engine(node.admin_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
    finally:
        engine.dispose()


def _terminate(node: Node) -> None:
    """SIGTERM (a clean shutdown that saves the node's position), SIGKILL if it takes too long."""
    if node.pid is None or not _alive(node.pid):
        _reap(node, timeout=1)
        return
    os.kill(node.pid, signal.SIGTERM)
    if not _reap(node, timeout=STOP_TIMEOUT):
        os.kill(node.pid, signal.SIGKILL)
        _reap(node, timeout=STOP_TIMEOUT)


def _reap(node: Node, timeout: float) -> bool:
    """Wait for the node's process to end (reaping it if it is our child); True if it did."""
    if node.process is not None:
        try:
            node.process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    while _alive(node.pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (ended, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together so none repeats)."""
    probes = []
    try:
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind(("127.0.0.1", 0))
            probes.append(probe)
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


#: Run beside the tests: once the process that started the cluster is gone
#: without stopping it (a SIGKILL ends pytest without its teardown), kill
#: every node whose command line names the directory and remove the directory.
WATCHDOG = """
import os, shutil, signal, sys, time

owner, workdir = int(sys.argv[1]), sys.argv[2]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


while alive(owner) and os.path.isdir(workdir):
    time.sleep(1)
for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
        continue
    try:
        with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
            if workdir.encode() in cmdline.read():
                os.kill(int(entry), signal.SIGKILL)
    except OSError:
        pass
time.sleep(1)
shutil.rmtree(workdir, ignore_errors=True)
"""


def _start_watchdog(workdir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(workdir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives a signal to the test run's process group
    )


# python -m tests.galera start|stop --------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.galera", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["start", "stop"])
    parser.add_argument("--nodes", type=int, default=3, help="how many nodes (start; default 3)")
    parser.add_argument(
        "--state",
        type=Path,
        default=DEFAULT_STATE,
        help=f"where the cluster is recorded (default {DEFAULT_STATE})",
    )
    args = parser.parse_args(argv)
    if args.command == "start":
        if args.state.exists():
            print(f"a cluster is recorded in {args.state} already: stop it first", file=sys.stderr)
            return 1
        try:
            cluster = start_cluster(args.nodes, watch=False)
        except GaleraUnavailable as error:
            print(error, file=sys.stderr)
            return 1
        args.state.write_text(json.dumps(cluster.state(), indent=2) + "\n")
        for url in cluster.urls:
            print(url)
        return 0
    if not args.state.exists():
        print(f"no cluster recorded in {args.state}", file=sys.stderr)
        return 1
    state = json.loads(args.state.read_text())
    workdir = Path(state["workdir"])
    nodes = [
        Node(index, workdir / f"node{index}", 0, 0, 0, 0, pid=pid) for index, pid in enumerate(state["pids"])
    ]
    # Recorded pids are only ours while their command line names our directory.
    for node in nodes:
        if node.pid is not None and not _names(node.pid, workdir):
            node.pid = None
    GaleraCluster(workdir, nodes, None).stop()
    args.state.unlink()
    print(f"stopped; removed {workdir}")
    return 0


def _names(pid: int, workdir: Path) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return str(workdir).encode() in cmdline.read()
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
