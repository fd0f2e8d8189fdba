"""What the ranks' own step reports say about the job's progress: the measured side of every
outcome.

A rank reports each step it enters (`Step`); entering step k says it completed k - 1. From those
reports alone the tracker knows the most advanced step any rank completed (`high_water`), the first
step each rank entered in the current generation of the world (`resumed`), and every step that was
entered again after some rank had completed it (`recomputed`, the independent count that an
outcome's claim of "0 steps recomputed" is checked against).
"""

from __future__ import annotations

from collections.abc import Callable


class StepTracker:
    def __init__(self, on_advance: Callable[[int], None] | None = None) -> None:
        # told each new high water (the job keeps it on disk: `resume`)
        self._on_advance = on_advance
        self.high_water = -1  # the most advanced step any rank has completed
        self.settled = -1  # ... as of the start of the current generation
        self.recomputed: set[int] = set()
        self.resumed: dict[int, int] = {}  # slot -> first step entered in the current generation

    def begin_generation(self) -> None:
        self.settled = self.high_water
        self.resumed = {}

    def entered(self, slot: int, step: int, completed_before: int) -> None:
        """Rank `slot`, which had completed `completed_before`, enters `step`.

        A step entered again after any rank completed it is recomputed work. Across ranks only the
        completions before this generation count: within one, frames of different ranks may be read
        out of order."""
        if step <= self.settled or step <= completed_before:
            self.recomputed.add(step)
        self.resumed.setdefault(slot, step)
        self.completed(step - 1)

    def completed(self, step: int) -> None:
        if step > self.high_water:
            self.high_water = step
            if self._on_advance is not None:
                self._on_advance(step)

    def recomputed_after(self, step_before: int) -> int:
        """Steps the ranks will run again: every completed step from the lowest first step of this
        generation up to `step_before` (both measured from the ranks' reports). They count as
        recomputed in the job's result from now on, run again before the job ends or not (a job
        stopped first lost that work all the same): one count, the incident's and the result's."""
        if not self.resumed:
            return 0
        first = min(self.resumed.values())
        self.recomputed.update(range(first, step_before + 1))
        return max(0, step_before + 1 - first)
