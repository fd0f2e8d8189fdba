"""Pure decisions of the migration workflow."""

from __future__ import annotations

from enum import StrEnum

from torchpass.models import Category, Classification, ConfirmResult


class RecoveryAction(StrEnum):
    MIGRATE = "migrate"
    FALLBACK = "fallback"
    NOTHING = "nothing"


def plan_recovery(classification: Classification, confirm: ConfirmResult) -> RecoveryAction:
    """Nothing to do for a false alarm; a checkpoint restart where live migration cannot help."""
    if not confirm.confirmed:
        return RecoveryAction.NOTHING
    if classification.category in (Category.UNABLE_TO_RECOVER, Category.SHARED_INFRASTRUCTURE):
        return RecoveryAction.FALLBACK
    return RecoveryAction.MIGRATE
