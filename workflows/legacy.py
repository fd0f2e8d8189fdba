"""MigrationWorkflow's behaviour before the `measured-outcome` patch, kept only so that histories
recorded before it replay as they ran. Remove once no such incident can still be in flight.

Both read the live classification table inside workflow code, which is why they were replaced: the
classification now has one owner, the `classify_failure` activity.
"""

from __future__ import annotations

from torchpass.classify import CATEGORY_OF, NO_SPARE_REASON, ROW_TITLE, primary_kind, unable_to_recover
from torchpass.models import QUALIFYING_CATEGORIES, Classification, Evidence, FailureKind


def judged_by_kind(evidence: tuple[Evidence, ...], error: str) -> Classification:
    category = CATEGORY_OF[primary_kind(evidence)]
    return Classification(
        category=category,
        qualifying=category in QUALIFYING_CATEGORIES,
        reason=f"{ROW_TITLE[category]}, judged by the failure's kind alone ({error})",
    )


def no_spare() -> Classification:
    return unable_to_recover(NO_SPARE_REASON)


def kind_of(evidence: list[Evidence] | tuple[Evidence, ...]) -> FailureKind:
    return primary_kind(evidence)
