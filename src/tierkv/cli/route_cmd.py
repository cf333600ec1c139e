"""`tierkv route`: the OpenAI-compatible router in front of several `tierkv serve` nodes."""

from __future__ import annotations

from typing import Annotated

import typer

from tierkv.cli.common import CLIError, Debug, app, console


@app.command("route", epilog="Example: `tierkv route --node http://10.0.0.1:8000 --node http://10.0.0.2:8000 "
                             "--port 9000`, then point an OpenAI client at http://localhost:9000/v1")
def route_cmd(
    node: Annotated[list[str], typer.Option("--node", help="A `tierkv serve` base URL; repeat for each node.")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port (0 picks a free one; the first "
                                      "line printed names the port bound).")] = 9000,
    policy: Annotated[str, typer.Option("--policy", help="cost_model, tier_weighted, longest_prefix, hash "
                                        "or round_robin.")] = "cost_model",
    timeout: Annotated[float, typer.Option("--timeout", min=0.01, help="Seconds a node may take to answer a "
                                           "status or match request before it is skipped.")] = 1.0,
    poll: Annotated[float, typer.Option("--poll", min=0.01, help="Seconds between node status polls.")] = 0.5,
    queue_weight: Annotated[float | None, typer.Option("--queue-weight", min=0.0,
                                                       help="tier_weighted: k per queued request.")] = None,
    debug: Debug = False,
) -> None:
    """Route OpenAI requests to the node whose cache and queue give the lowest time to first token."""
    import socket

    import uvicorn

    from tierkv.route.nodes import NodePool
    from tierkv.route.policy import ROUTERS
    from tierkv.route.proxy import RouteProxy

    if policy not in ROUTERS:
        raise CLIError(f"--policy: expected one of {sorted(ROUTERS)}, got {policy!r}", 2)
    options = {"queue_weight": queue_weight} if queue_weight is not None and policy == "tier_weighted" else {}
    try:
        proxy = RouteProxy(NodePool(node, timeout_s=timeout, poll_s=poll), policy, **options)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    # Bound here, not by uvicorn: with --port 0 the line below names the port the kernel gave, and a caller
    # that reads it (tests, scripts) can never race another process for a port picked before the bind.
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise CLIError(f"--port: cannot listen on {host}:{port}: {exc.strerror}") from None
    bound_host, bound_port = sock.getsockname()[:2]
    where = f"[{bound_host}]" if ":" in bound_host else bound_host
    console.print(f"tierkv route: {policy} over {len(node)} nodes on http://{where}:{bound_port}/v1", markup=False,
                  soft_wrap=True)
    try:
        uvicorn.Server(uvicorn.Config(proxy.app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        sock.close()
