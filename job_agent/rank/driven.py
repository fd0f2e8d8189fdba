"""The agent's step boundary for a training loop a framework owns (Hugging Face's `Trainer`,
Lightning's): the framework's own hooks say where each step begins and ends, and a step that a
peer's loss failed is done again inside the very call where it failed, so the framework's loop never
sees the failure.

    steps = DrivenSteps(agent)
    steps.begin(total)          # the job's group forms (a warm spare: waits for its slot and state)
    steps.enter(k)              # step k begins: a planned move is obeyed here, the step reported
    try:
        ...                     # the step's work, up to its optimizer's step
    except Exception as e:
        if not steps.failed(k, e):
            raise               # the script's own error: reported, and it propagates
        ...                     # frozen, regrouped: enter(k) again and redo the step's work
    steps.complete(k)           # after the optimizer's step
    steps.finish()              # every step done: the job's word to exit
"""

from __future__ import annotations

from job_agent.rank.loop import LoopAgent, step_failure
from job_agent.rank.rngs import seed_globals
from job_agent.rank.tensors import step_seed


class DrivenSteps:
    """The step boundary of a rank whose loop a framework runs."""

    def __init__(self, agent: LoopAgent) -> None:
        self.agent = agent

    def begin(self, total: int) -> None:
        """Training begins (`total` steps in all): this rank says it is ready and the job's group
        forms; a warm spare returns once it holds a slot and the state of the step it starts at."""
        self.agent._begin(total)

    def enter(self, k: int) -> None:
        """Step `k` begins (so `k - 1` is complete): a planned move asked for is obeyed here, then
        the step is reported and what a step done again starts from is kept."""
        self.agent._check_inbox()
        self.agent._enter_step(k)

    def reseed(self, k: int) -> None:
        """Seed the global random streams as step `k` began, again: where the framework draws
        between the step's start and its model's first forward (a data loader starting an
        iterator draws its seed), the forward then draws the same on every try and on a spare."""
        seed_globals(step_seed(self.agent.settings.seed, k, self.agent.rank))

    def failed(self, k: int | None, e: BaseException) -> bool:
        """What an exception raised in step `k` means: True when a peer's loss failed a collective
        (this rank froze and the group re-formed: do the step's work again, after `enter(k)`); False
        for the script's own error (reported as such: let it propagate). `k` None: between steps
        (the step before is complete: nothing to do again)."""
        reason = step_failure(-1 if k is None else k, e, self.agent._send)
        if reason is None:
            return False
        self.agent._freeze(k, reason)
        return True

    def complete(self, k: int) -> None:
        """Step `k`'s optimizer stepped: the step is complete."""
        self.agent._after_step()
        self.agent._complete_step(k)

    def finish(self) -> None:
        """Every step is done: the job's word to exit is waited for."""
        self.agent._finish()
