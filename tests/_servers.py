"""Real pool servers on loopback, on free ports, stopped by process id (fixtures for tests/remote and tests/vllm).

``redis_server`` starts ``redis-server``; ``mooncake_pool`` starts
``mooncake_master`` (with its built-in HTTP metadata server) plus one
``mooncake_client`` process that contributes the pool's memory, so values
outlive the tierkv clients that wrote them. Each fixture object can
``kill()`` its server with SIGKILL and ``restart()`` it on the same ports.
A test skips only when the server cannot be installed here, and says why.

redis-server and mooncake_master cannot bind port 0 and report the port they got, so their ports are
picked here (``free_port``) and bound by the server a moment later; another process on the machine can
take one in between. A server counts as started only once *its own process* listens on all its ports
(read from /proc, not by connecting: a connect would also succeed to whoever took the port); if a port
was taken by another process at the first start, it is started again on fresh ports (``Server.repick``).
A restart keeps its ports (clients know them), so there a taken port is an error that says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

REDIS_BIN = shutil.which("redis-server")


_GIVEN: set[int] = set()


def free_port(below: int = 65536) -> int:
    """A loopback port nobody listens on, never handed out twice in this session, under ``below``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below and port not in _GIVEN:
            _GIVEN.add(port)
            return port


class PortTaken(RuntimeError):
    """A server could not listen on a port because another process holds it."""


def _listening(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux: its socket fds matched to /proc/net/tcp{,6})."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _held_elsewhere(port: int) -> bool:
    """Whether a socket we did not make listens on (or exclusively holds) loopback ``port``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError:
            return True


def wait_listening(name: str, ports: list[int], proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    """Wait until ``proc`` itself listens on every port of ``ports``. Raises PortTaken when it exited or
    timed out while another process holds one of them, RuntimeError (with its log) otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        exited = proc.poll() is not None
        missing = [] if exited else [p for p in ports if p not in _listening(proc.pid)]
        if not exited and not missing:
            return
        if exited or time.monotonic() > deadline:
            missing = missing or ports
            taken = [p for p in missing if _held_elsewhere(p)]
            why = f"exited with {proc.returncode}" if exited else f"not listening on {missing} after {timeout}s"
            if taken:
                raise PortTaken(f"{name}: port(s) {taken} taken by another process ({why}): "
                                f"{log.read_text()[-2000:]}")
            raise RuntimeError(f"{name} {why}: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def wait_port_free(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                time.sleep(0.05)


class Server:
    """One server process: start, SIGKILL, restart on the same ports, stop (all by pid).

    ``ports``: every port it must listen on before it counts as started. ``repick`` (optional) picks fresh
    ports and updates ``argv``/``ports``: the first start retries with it when a port was taken."""

    def __init__(self, argv: list[str], ports: list[int], workdir: Path, name: str,
                 repick: Callable[[], None] | None = None) -> None:
        self.argv, self.ports, self.workdir, self.name, self.repick = argv, ports, workdir, name, repick
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"{name}.log"

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        attempts = 5 if self.proc is None and self.repick is not None else 1  # a restart keeps its ports
        for attempt in range(attempts):
            if attempt:
                self.repick()
            if attempts == 1:  # a restart: the killed process's sockets may take a moment to go
                for port in self.ports:
                    wait_port_free(port)
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                wait_listening(self.name, self.ports, self.proc, self.log)
                return
            except PortTaken:
                self.kill()
                if attempt == attempts - 1:
                    raise
            except BaseException:
                self.kill()
                raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung pool)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


class RedisServer(Server):
    def __init__(self, workdir: Path, cluster: bool = False, tls: bool = False) -> None:
        self.workdir, self.cluster, self.tls = workdir, cluster, tls
        if tls:
            self.cert = workdir / "cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(workdir / "key.pem"), "-out", str(self.cert)],
                           check=True, capture_output=True, timeout=60)
        super().__init__(*self._argv_ports(), workdir, "redis", repick=self._repick)

    def _argv_ports(self) -> tuple[list[str], list[int]]:
        port = free_port(below=55536) if self.cluster else free_port()  # the cluster bus listens on port + 10000
        argv = [REDIS_BIN, "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf")]
        if self.tls:
            argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                     "--tls-key-file", str(self.workdir / "key.pem"), "--tls-ca-cert-file", str(self.cert),
                     "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(port)]
        return argv, [port, port + 10000] if self.cluster else [port]

    def _repick(self) -> None:
        self.argv, self.ports = self._argv_ports()

    @property
    def url(self) -> str:
        if self.cluster:
            return f"redis+cluster://127.0.0.1:{self.port}"
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://127.0.0.1:{self.port}/0"

    def plant(self, name: str, value: bytes) -> None:
        c = self.client()
        c.set(name, value)
        c.close()

    def client(self):
        import redis

        if self.tls:
            return redis.Redis.from_url(self.url, socket_timeout=5)
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        super().start()
        if self.cluster:
            c = self.client()
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 10
            while c.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
                if time.monotonic() > deadline:
                    raise RuntimeError("single-node redis cluster did not become ok")
                time.sleep(0.05)
            c.close()


class MooncakePool:
    """mooncake_master (RPC + HTTP metadata) and one mooncake_client holding ``segment`` bytes."""

    def __init__(self, workdir: Path, segment: str = "64MB", master_flags: tuple[str, ...] = ()) -> None:
        import mooncake

        self.pkg, self.segment, self.master_flags = Path(mooncake.__path__[0]), segment, master_flags
        self.rpc_port, self.meta_port, self.metrics_port, self.pool_port = (free_port() for _ in range(4))
        self.master = Server(self._master_argv(), self._master_ports(), workdir, "mooncake_master",
                             repick=self._repick_master)
        self.pool = Server(self._pool_argv(), [self.pool_port], workdir, "mooncake_client", repick=self._repick_pool)

    def _master_ports(self) -> list[int]:
        return [self.rpc_port, self.meta_port, self.metrics_port]

    def _master_argv(self) -> list[str]:
        return [str(self.pkg / "mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.meta_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--logtostderr", *self.master_flags]

    def _pool_argv(self) -> list[str]:
        return [str(self.pkg / "mooncake_client"), "--host=127.0.0.1", f"--port={self.pool_port}",
                f"--global_segment_size={self.segment}", f"--master_server_address=127.0.0.1:{self.rpc_port}",
                f"--metadata_server={self.metadata}", "--protocol=tcp", "--logtostderr"]

    def _repick_master(self) -> None:
        # The client is started after the master, so its command can still change with the master's ports.
        self.rpc_port, self.meta_port, self.metrics_port = (free_port() for _ in range(3))
        self.master.argv, self.master.ports = self._master_argv(), self._master_ports()
        self.pool.argv = self._pool_argv()

    def _repick_pool(self) -> None:
        self.pool_port = free_port()
        self.pool.argv, self.pool.ports = self._pool_argv(), [self.pool_port]

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}&protocol=tcp&local=127.0.0.1"

    def start(self) -> None:
        try:
            self.master.start()
            self.pool.start()
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the master (the pool's memory process keeps running, as on a real fleet)."""
        self.master.kill()

    def restart(self) -> None:
        self.master.restart()

    def pause(self) -> None:
        self.master.pause()

    def resume(self) -> None:
        self.master.resume()

    def plant(self, name: str, value: bytes) -> None:
        """Store ``value`` under ``name`` with Mooncake's own client, replacing what is there."""
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", self.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{self.rpc_port}") == 0
        try:
            # Setting up the test, not testing: on a loaded host the master's RPC can time out, so retry.
            deadline = time.monotonic() + 60
            # A put that answered 0 has been seen not to be there a moment later (once, at load 8):
            # the plant counts only once the master lists the object.
            while True:
                raw.remove(name, True)
                if raw.put(name, value) == 0 and raw.is_exist(name) == 1:
                    break
                assert time.monotonic() < deadline, f"planting {name} failed"
                time.sleep(0.2)
        finally:
            raw.close()

    def stop(self) -> None:
        self.pool.stop()
        self.master.stop()


def _running(server):
    """Start ``server`` for one test and stop it (by pid) afterwards, whatever happened."""
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path):
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed and scripts/install-system-deps.sh could not install it "
                    "(needs root and apt-get)")
    pytest.importorskip("redis", reason="redis-py missing: pip install 'tierkv[redis]'")
    yield from _running(RedisServer(tmp_path))


@pytest.fixture
def redis_tls(tmp_path: Path):
    if REDIS_BIN is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl is not installed and could not be installed here")
    pytest.importorskip("redis", reason="redis-py missing: pip install 'tierkv[redis]'")
    yield from _running(RedisServer(tmp_path, tls=True))


@pytest.fixture
def redis_cluster(tmp_path: Path):
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed and scripts/install-system-deps.sh could not install it")
    pytest.importorskip("redis", reason="redis-py missing: pip install 'tierkv[redis]'")
    yield from _running(RedisServer(tmp_path, cluster=True))


def _mooncake_or_skip() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake-transfer-engine cannot be imported here ({exc}); "
                    "pip install 'tierkv[mooncake]' and apt-get install libibverbs1")


@pytest.fixture
def mooncake_pool(tmp_path: Path):
    _mooncake_or_skip()
    pool = MooncakePool(tmp_path)
    pool.start()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def make_mooncake_pool(tmp_path: Path):
    """Factory for pools with a custom segment size and master flags (memory-pressure tests)."""
    _mooncake_or_skip()
    made: list[MooncakePool] = []

    def make(segment: str, *flags: str) -> MooncakePool:
        pool = MooncakePool(tmp_path, segment, tuple(flags))
        made.append(pool)
        pool.start()
        return pool

    yield make
    for pool in made:
        pool.stop()
