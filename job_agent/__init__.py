"""The job agent: the rank agent inside training processes, the per-job coordinator and the node
agent.

`RankAgent` and `CollectiveFailure` are what a training script imports (`from job_agent import
RankAgent`). They load on first use, so that importing the coordinator or the node agent, which
never import torch, does not load it through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from job_agent.rank.agent import CollectiveFailure, RankAgent

__all__ = ["CollectiveFailure", "RankAgent"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from job_agent.rank import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'job_agent' has no attribute {name!r}")
