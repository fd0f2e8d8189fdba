"""The job agent: the rank agent inside training processes and the per-job coordinator. Torch only."""

from job_agent.rank.agent import CollectiveFailure, RankAgent

__all__ = ["CollectiveFailure", "RankAgent"]
