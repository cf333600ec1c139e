"""Routing across a fleet of tierkv nodes: the TTFT cost model, routing policies, the global index."""

from tierkv.route.policy import ROUTERS, Candidate, Prompt, Router, make_router
from tierkv.route.ttft import estimate_ttft_us

__all__ = ["ROUTERS", "Candidate", "Prompt", "Router", "estimate_ttft_us", "make_router"]
