"""Real pool servers on loopback, on free ports, stopped by process id (fixtures for tests/remote and tests/vllm).

``redis_server`` starts ``redis-server``; ``mooncake_pool`` starts
``mooncake_master`` (with its built-in HTTP metadata server) plus one
``mooncake_client`` process that contributes the pool's memory, so values
outlive the tierkv clients that wrote them. Each fixture object can
``kill()`` its server with SIGKILL and ``restart()`` it on the same ports.
A test skips only when the server cannot be installed here, and says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

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


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening after {timeout}s: {log.read_text()[-2000:]}")


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
    """One server process: start, SIGKILL, restart on the same ports, stop (all by pid)."""

    def __init__(self, argv: list[str], port: int, workdir: Path, name: str) -> None:
        self.argv, self.port, self.workdir, self.name = argv, port, workdir, name
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"{name}.log"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        wait_port_free(self.port)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, self.proc, self.log)

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
        port = free_port(below=55536) if cluster else free_port()  # the cluster bus listens on port + 10000
        argv = [REDIS_BIN, "--bind", "127.0.0.1", "--dir", str(workdir),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        if cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf")]
        if tls:
            self.cert = workdir / "cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(workdir / "key.pem"), "-out", str(self.cert)],
                           check=True, capture_output=True, timeout=60)
            argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                     "--tls-key-file", str(workdir / "key.pem"), "--tls-ca-cert-file", str(self.cert),
                     "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(port)]
        super().__init__(argv, port, workdir, "redis")
        self.cluster, self.tls = cluster, tls

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

        pkg = Path(mooncake.__path__[0])
        self.rpc_port, self.meta_port, self.metrics_port, self.pool_port = (free_port() for _ in range(4))
        master = [str(pkg / "mooncake_master"), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                  "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                  f"--http_metadata_server_port={self.meta_port}", "--metrics_host=127.0.0.1",
                  f"--metrics_port={self.metrics_port}", "--logtostderr", *master_flags]
        pool = [str(pkg / "mooncake_client"), "--host=127.0.0.1", f"--port={self.pool_port}",
                f"--global_segment_size={segment}", f"--master_server_address=127.0.0.1:{self.rpc_port}",
                f"--metadata_server={self.metadata}", "--protocol=tcp", "--logtostderr"]
        self.master = Server(master, self.rpc_port, workdir, "mooncake_master")
        self.pool = Server(pool, self.pool_port, workdir, "mooncake_client")

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
