"""The workflow's pure decisions: what follows a classification."""

from __future__ import annotations

import pytest

from torchpass.incident.decisions import RecoveryAction, plan_recovery
from torchpass.incident.steps import ConfirmResult
from torchpass.models import QUALIFYING_CATEGORIES, Category, Classification


def confirm(confirmed: bool = True) -> ConfirmResult:
    return ConfirmResult(
        confirmed=confirmed,
        lost_slots=(1,),
        fenced_slots=(1,),
        world_size=4,
        redundancy=4,
        generation=0,
        covered=True,
    )


def classification(category: Category) -> Classification:
    return Classification(
        category=category, qualifying=category in QUALIFYING_CATEGORIES, reason="r"
    )


@pytest.mark.parametrize("category", sorted(QUALIFYING_CATEGORIES))
def test_a_confirmed_qualifying_failure_is_migrated(category: Category) -> None:
    assert plan_recovery(classification(category), confirm()) is RecoveryAction.MIGRATE


@pytest.mark.parametrize("category", [Category.SHARED_INFRASTRUCTURE, Category.UNABLE_TO_RECOVER])
def test_a_confirmed_disqualified_failure_falls_back_to_a_restart(category: Category) -> None:
    assert plan_recovery(classification(category), confirm()) is RecoveryAction.FALLBACK


@pytest.mark.parametrize("category", list(Category))
def test_an_unconfirmed_report_changes_nothing(category: Category) -> None:
    assert (
        plan_recovery(classification(category), confirm(confirmed=False)) is RecoveryAction.NOTHING
    )
