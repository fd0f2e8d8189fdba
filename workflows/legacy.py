"""MigrationWorkflow's behaviour before the `measured-outcome` patch, kept only so that histories
recorded before it replay as they ran. Remove once no such incident can still be in flight.

Both read the live classification table inside workflow code, which is why they were replaced: the
classification now has one owner, the `classify_failure` activity.
"""

from __future__ import annotations

from torchpass.incident.classify import (
    CATEGORY_OF,
    NO_SPARE_REASON,
    ROW_TITLE,
    primary_kind,
    unable_to_recover,
)
from torchpass.incident.steps import ConfirmResult
from torchpass.models import (
    QUALIFYING_CATEGORIES,
    Classification,
    ClassifyInput,
    Evidence,
    FailureKind,
)


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


def classify_input(evidence: tuple[Evidence, ...], confirm: ConfirmResult | None) -> ClassifyInput:
    """What the classifier saw before the patch: no shards, no spare availability."""
    return ClassifyInput(
        evidence=evidence,
        lost_slots=confirm.lost_slots if confirm else (),
        world_size=confirm.world_size if confirm else 0,
        redundancy=confirm.redundancy if confirm else 0,
    )
