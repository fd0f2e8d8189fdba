"""Lightning under the agent.

`AgentEnvironment` is the cluster environment Lightning is given so that it takes the job's
processes as they are: the agent started them (Lightning launches none), the agent forms their
group, and a process's rank is the agent's, a warm spare's once it holds a slot (rank 0's view until
then, as the placeholder group gives it). `LiveFabricStrategy` is Fabric's DDP strategy on it, each
process on the agent's device for it. Fabric's script runs the agent's loop form:

    agent = RankAgent()                                        # torchpass: first
    fabric = Fabric(accelerator="cpu", devices=agent.world_size,
                    strategy=LiveFabricStrategy(agent))        # torchpass
    fabric.launch()
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(loader)
    agent.track(model, opt.optimizer, sched=sched)             # torchpass
    for step in agent.steps(n, data=loader):                   # torchpass: the agent's loop form
        with step:
            ...fabric.backward(loss)...

Lightning's `Trainer` runs its own loop: `LiveDDPStrategy` (`lightning_trainer.py`) puts the agent's
step boundary in it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies import DDPStrategy

from job_agent.rank.agent import RankAgent


class AgentEnvironment(ClusterEnvironment):
    """The job's processes as the agent runs them, for Lightning."""

    def __init__(self, agent: RankAgent) -> None:
        super().__init__()
        self.agent = agent

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the job started them: Lightning launches none

    @property
    def main_address(self) -> str:
        return self.agent.settings.store_addr[0]  # the job's store: the agent forms the group

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return "TORCHPASS_AGENT_ID" in os.environ

    def world_size(self) -> int:
        return self.agent.world_size

    def set_world_size(self, size: int) -> None:
        pass  # the job's, fixed

    def global_rank(self) -> int:
        return max(self.agent.rank, 0)

    def set_global_rank(self, rank: int) -> None:
        pass  # the agent's: a spare's changes as it takes a slot

    def local_rank(self) -> int:
        return self.agent.settings.local_rank

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", "0"))


class LiveFabricStrategy(DDPStrategy):
    """Fabric's DDP strategy on the agent's processes (`AgentEnvironment`), each on the device the
    agent gives it: a warm spare's is its own (a GPU past the job's ranks' on its node), which
    Fabric's list of the job's devices does not hold."""

    def __init__(self, agent: RankAgent, **kwargs: Any) -> None:
        super().__init__(cluster_environment=AgentEnvironment(agent), **kwargs)
        self.agent = agent

    @property
    def root_device(self) -> torch.device:
        return self.agent.device
