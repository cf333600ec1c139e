"""The pool-server fixtures (tests/_servers.py) when another process takes a port picked for them.

redis-server and mooncake_master are given ports picked a moment before they bind them. Here the test is
the other process: it listens on the picked port in between. The first start notices (the server's own
process must listen on each port, a connect is not enough) and starts again on fresh ports; a restart,
which must keep its ports, fails with an error naming the server and the port.
"""

from __future__ import annotations

import socket

import pytest

from _servers import REDIS_BIN, MooncakePool, PortTaken, RedisServer, _listening, _mooncake_or_skip


def redis_or_skip() -> None:
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (make system-deps)")
    pytest.importorskip("redis", reason="redis-py missing: pip install 'tierkv[redis]'")


@pytest.mark.redis
def test_redis_first_start_moves_off_a_port_taken_after_it_was_picked(tmp_path):
    redis_or_skip()
    server = RedisServer(tmp_path)
    picked = server.port
    with socket.create_server(("127.0.0.1", picked)):  # another process got there first
        server.start()
        try:
            assert server.port != picked
            assert _listening(server.pid) == {server.port}
            c = server.client()
            assert c.ping() and c.info("server")["process_id"] == server.pid
            c.close()
            assert "Address already in use" in server.log.read_text()  # the first try, on the taken port
        finally:
            server.stop()


@pytest.mark.redis
def test_redis_restart_on_a_taken_port_says_which_port(tmp_path):
    redis_or_skip()
    server = RedisServer(tmp_path)
    server.start()
    port = server.port
    server.kill()
    try:
        with socket.create_server(("127.0.0.1", port)), pytest.raises(PortTaken) as err:
            server.restart()
        assert str(err.value).startswith(f"redis: port(s) [{port}] taken by another process (exited with 1)")
        assert server.port == port  # a restart keeps its port: clients know it
    finally:
        server.stop()


@pytest.mark.mooncake
def test_mooncake_first_start_moves_off_a_taken_metadata_port(tmp_path):
    _mooncake_or_skip()
    pool = MooncakePool(tmp_path)
    picked = pool.meta_port
    with socket.create_server(("127.0.0.1", picked)):
        pool.start()
        try:
            assert pool.meta_port != picked
            assert {pool.rpc_port, pool.meta_port, pool.metrics_port} <= _listening(pool.master.pid)
            assert pool.pool.argv[pool.pool.argv.index("--protocol=tcp") - 1] == f"--metadata_server={pool.metadata}"
            assert f"Failed to start HTTP metadata server on 127.0.0.1:{picked}" in pool.master.log.read_text()
            pool.plant("k", b"v" * 64)  # the client joined the pool through the new ports
        finally:
            pool.stop()
