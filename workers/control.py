"""The control worker: MigrationWorkflow and the cluster-wide activities, on the control task queue."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.worker import Worker

from activities.control import ControlActivities
from torchpass.ids import CONTROL_TASK_QUEUE
from workflows.migration import MigrationWorkflow


def control_worker(client: Client, task_queue: str = CONTROL_TASK_QUEUE) -> Worker:
    acts = ControlActivities()
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[MigrationWorkflow],
        activities=[acts.classify_failure],
    )
