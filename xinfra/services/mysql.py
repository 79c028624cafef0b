"""MySQL for the metadata store: the server at 127.0.0.1:3306 when it answers, else a private MariaDB.

Tests get a database of their own (``create_database``) so that runs never see
each other's rows.
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pymysql

from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess, ServiceError, which_any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 3306


@dataclass
class MysqlServer:
    host: str
    port: int
    user: str = "root"
    password: str = ""
    process: ManagedProcess | None = None  # None: a server we did not start and must not stop

    def url(self, database: str) -> str:
        """A SQLAlchemy URL (PyMySQL driver) for one database on this server."""
        auth = self.user if not self.password else f"{self.user}:{self.password}"
        return f"mysql+pymysql://{auth}@{self.host}:{self.port}/{database}?charset=utf8mb4"

    def connect(self, database: str | None = None) -> pymysql.connections.Connection:
        return pymysql.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            database=database,
            connect_timeout=3,
            autocommit=True,
        )

    def create_database(self, name: str) -> str:
        with self.connect() as connection, connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with self.connect() as connection, connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")

    def answers(self) -> bool:
        try:
            self.connect().close()
            return True
        except pymysql.MySQLError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def ensure_mysql(run_dir: Path) -> MysqlServer:
    """The machine's MySQL when it answers as root without a password; otherwise start MariaDB."""
    existing = MysqlServer(DEFAULT_HOST, DEFAULT_PORT)
    if existing.answers():
        return existing
    return start_mariadb(run_dir / "mariadb")


def start_mariadb(data_dir: Path, port: int | None = None) -> MysqlServer:
    server_binary = which_any(["/usr/sbin/mariadbd", "/usr/sbin/mysqld"]) or (
        Path(found) if (found := shutil.which("mariadbd")) else None
    )
    install_db = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
    if server_binary is None or install_db is None:
        raise ServiceError(
            "no MySQL answers at 127.0.0.1:3306 and MariaDB is not installed "
            "(apt-get install mariadb-server)"
        )
    port = port or free_port()
    datadir = data_dir / "data"
    if not (datadir / "mysql").exists():
        datadir.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                install_db,
                "--no-defaults",
                f"--datadir={datadir}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                f"--user={getpass.getuser()}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise ServiceError(f"mariadb-install-db failed:\n{result.stdout}\n{result.stderr}")
    process = ManagedProcess(
        name="mariadb",
        argv=[
            str(server_binary),
            "--no-defaults",
            f"--datadir={datadir}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--socket={data_dir / 'mysqld.sock'}",
            f"--user={getpass.getuser()}",
            "--skip-log-bin",
            "--innodb-buffer-pool-size=128M",
        ],
        log_path=data_dir / "mariadb.log",
        url=f"{DEFAULT_HOST}:{port}",
    )
    server = MysqlServer(DEFAULT_HOST, port, process=process)
    process.start().wait_ready(server.answers, timeout_s=60)
    return server
