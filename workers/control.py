"""The control worker: the workflows and the cluster-wide activities, on the control task queue.

Workflows: MigrationWorkflow (one per incident), ContractWorkflow (one per YOCO contract),
EnvironmentValidationWorkflow (opt-in). Activities: classification, environment checks, the ledger's
checks of what a contract is told, credit delivery to billing (settings from TORCHPASS_BILLING_*,
see deploy/README.md).
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.worker import Worker

from activities.billing import BillingActivities
from activities.control import ControlActivities
from activities.ledger import LedgerActivities
from activities.validation import validation_activities
from torchpass.ids import CONTROL_TASK_QUEUE
from torchpass.policies import STICKY_PICKUP
from workers.settings import Settings
from workflows.contract import CONTRACT_WORKFLOWS
from workflows.migration import MigrationWorkflow
from workflows.validation import VALIDATION_WORKFLOWS


def control_worker(
    client: Client, settings: Settings | None = None, task_queue: str = CONTROL_TASK_QUEUE
) -> Worker:
    """The worker for `settings` (the process's own; the environment's when not given)."""
    settings = settings or Settings.load()
    acts = ControlActivities()
    credits = BillingActivities(settings.billing, client)
    ledger = LedgerActivities(client)
    return Worker(
        client,
        task_queue=task_queue,
        sticky_queue_schedule_to_start_timeout=STICKY_PICKUP,
        workflows=[MigrationWorkflow, *CONTRACT_WORKFLOWS, *VALIDATION_WORKFLOWS],
        activities=[
            acts.classify_failure,
            credits.deliver_credit,
            ledger.verify_outcomes,
            ledger.verify_validation,
            *validation_activities(settings.validation, client),
        ],
    )
