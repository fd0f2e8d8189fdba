"""The control worker: the workflows and the cluster-wide activities, on the control task queue.

Workflows: MigrationWorkflow (one per incident), ContractWorkflow (one per YOCO contract),
EnvironmentValidationWorkflow (opt-in). Activities: classification, environment checks, credit delivery
to billing (settings from TORCHPASS_BILLING_*, see deploy/README.md).
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.worker import Worker

from activities.billing import BillingActivities
from activities.control import ControlActivities
from activities.validation import ValidationSettings, validation_activities
from torchpass.billing import BillingSettings
from torchpass.ids import CONTROL_TASK_QUEUE
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.migration import MigrationWorkflow
from workflows.validation import VALIDATION_WORKFLOWS


def control_worker(
    client: Client,
    task_queue: str = CONTROL_TASK_QUEUE,
    billing: BillingSettings | None = None,
    validation: ValidationSettings | None = None,
) -> Worker:
    acts = ControlActivities()
    credits = BillingActivities(billing or BillingSettings(), client)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[MigrationWorkflow, *CONTRACT_WORKFLOWS, *VALIDATION_WORKFLOWS],
        activities=[
            acts.classify_failure,
            credits.deliver_credit,
            *validation_activities(validation, client),
        ],
    )
