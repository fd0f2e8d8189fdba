"""Cluster-wide activities served by the control worker."""

from __future__ import annotations

from temporalio import activity

from torchpass.ids import ControlActivity
from torchpass.incident.classify import classify
from torchpass.models import Classification, ClassifyInput


class ControlActivities:
    @activity.defn(name=ControlActivity.CLASSIFY_FAILURE)
    async def classify_failure(self, inp: ClassifyInput) -> Classification:
        return classify(inp)
