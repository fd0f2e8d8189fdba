"""Pure decisions of the migration workflow: what to do once an incident is confirmed and
classified.

No I/O and no workflow calls, so they are unit-tested without Temporal. How hard each step is
retried and how long it may take is in `torchpass.policies`.
"""

from __future__ import annotations

from enum import StrEnum

from torchpass.incident.steps import ConfirmResult
from torchpass.models import Category, Classification


class RecoveryAction(StrEnum):
    MIGRATE = "migrate"
    FALLBACK = "fallback"
    NOTHING = "nothing"


def plan_recovery(
    classification: Classification, confirm: ConfirmResult, resync: bool = False
) -> RecoveryAction:
    """Nothing for a false alarm; a checkpoint restart where live migration cannot help; else
    migrate. `resync`: a replica found corrupted, with a healthy majority of its shard to rebuild it
    from, is migrated live (the brief's table still does not count it)."""
    if not confirm.confirmed:
        return RecoveryAction.NOTHING
    if resync:
        return RecoveryAction.MIGRATE
    if classification.category in (Category.UNABLE_TO_RECOVER, Category.SHARED_INFRASTRUCTURE):
        return RecoveryAction.FALLBACK
    return RecoveryAction.MIGRATE
