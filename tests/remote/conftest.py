"""The real pool servers (``tests/_servers.py``) for the remote-tier tests."""

from _servers import make_mooncake_pool, mooncake_pool, redis_cluster, redis_server, redis_tls  # noqa: F401
