"""A throwaway PostgreSQL 15 cluster for the local stack and the tests.

Runs the server as the ``postgres`` user when we are root (initdb refuses root), binds it to
127.0.0.1 only and turns on prepared transactions. Standard library only: it runs before the
virtual environment has anything in it.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PG_BIN = Path(os.environ.get("TIDEMARK_PG_BIN", "/usr/lib/postgresql/15/bin"))
DEFAULT_PORT = 54329
USER = "tidemark"
PASSWORD = "tidemark"  # local development cluster on loopback only
DATABASES = ("tidemark", "warehouse")

SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    # Prepared transactions: tasks x sinks x 2 (sink + ledger DLQ) + recovery headroom.
    "max_prepared_transactions": "64",
    "max_connections": "200",
    "shared_buffers": "256MB",
    "fsync": "on",
    "synchronous_commit": "on",
    "log_min_messages": "warning",
    "log_min_error_statement": "panic",
    "logging_collector": "off",
}


@dataclass
class Cluster:
    root: Path
    port: int = DEFAULT_PORT
    overrides: dict[str, str] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sockets(self) -> Path:
        return self.root / "run"

    @property
    def logfile(self) -> Path:
        return self.root / "postgres.log"

    def dsn(self, database: str = "tidemark", user: str = USER, password: str = PASSWORD) -> str:
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{database}"

    # -- process control -------------------------------------------------------------------
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def initialized(self) -> bool:
        return (self.data / "PG_VERSION").exists()

    def init(self) -> None:
        if self.initialized():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for d in (self.root, self.sockets):
            d.mkdir(parents=True, exist_ok=True)
            self._chown(d)
        # postgres must be able to reach the folder; the repo may live under a 0700 home.
        _make_traversable(self.root)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            # A cluster that never fsyncs (a scratch one) need not wait for its files' sync.
            *(["--no-sync"] if self.overrides.get("fsync") == "off" else []),
        )
        conf = "\n".join(f"{k} = {v}" for k, v in {**SETTINGS, **self.overrides}.items())
        with open(self.data / "postgresql.auto.conf", "a") as fh:
            fh.write(f"\n{conf}\nport = {self.port}\nunix_socket_directories = '{self.sockets}'\n")

    def running(self) -> bool:
        return (
            self.initialized()
            and self._run("pg_ctl", "status", "-D", str(self.data), check=False).returncode == 0
        )

    def start(self) -> None:
        self.init()
        if not self.running():
            self.logfile.touch()
            self._chown(self.logfile)
            res = self._run(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                str(self.data),
                "-l",
                str(self.logfile),
                "-o",
                f"-p {self.port}",
                check=False,
            )
            if res.returncode != 0:
                tail = self.logfile.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"PostgreSQL did not start on port {self.port}: {tail.strip()}")
        self.bootstrap()

    def stop(self) -> None:
        if self.running():
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data))

    def destroy(self) -> None:
        # Immediate: the data goes next, so a shutdown checkpoint (seconds, with fsync on and
        # many dirty buffers) would be written for nothing.
        if self.running():
            self._run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(self.data))
        shutil.rmtree(self.root, ignore_errors=True)

    def psql(self, sql: str, database: str = "postgres") -> str:
        res = self._run(
            "psql",
            "-X",
            "-q",
            "-At",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            str(self.sockets),
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            database,
            "-c",
            sql,
        )
        return res.stdout.strip()

    def bootstrap(self) -> None:
        """Create the tidemark role and databases (idempotent)."""
        if not self.psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{USER}'"):
            self.psql(f"CREATE ROLE {USER} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
        for db in DATABASES:
            self.create_database(db)

    def create_database(self, name: str) -> None:
        if not self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'"):
            self.psql(f'CREATE DATABASE "{name}" OWNER {USER}')


def _make_traversable(path: Path) -> None:
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tidemark.devstack.localpg",
        description="Manage the local PostgreSQL cluster.",
    )
    ap.add_argument("action", choices=["start", "stop", "status", "dsn", "destroy"])
    ap.add_argument("--dir", default=".tidemark/pg", help="cluster folder (default: %(default)s)")
    ap.add_argument(
        "--port", type=int, default=int(os.environ.get("TIDEMARK_PG_PORT", DEFAULT_PORT))
    )
    ap.add_argument("--database", default="tidemark")
    args = ap.parse_args(argv)
    cluster = Cluster(Path(args.dir).resolve(), args.port)
    try:
        if args.action == "start":
            cluster.start()
            print(f"PostgreSQL 15 running on 127.0.0.1:{args.port} (data in {cluster.data})")
        elif args.action == "stop":
            cluster.stop()
            print("PostgreSQL stopped")
        elif args.action == "destroy":
            cluster.destroy()
        elif args.action == "status":
            print("running" if cluster.running() else "stopped")
            return 0 if cluster.running() else 3
        elif args.action == "dsn":
            print(cluster.dsn(args.database))
    except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        print(f"tidemark.devstack.localpg: {args.action} failed: {detail.strip()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
