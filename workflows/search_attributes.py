"""The search attributes a MigrationWorkflow keeps on its incident: the job, the failure's kind,
whether it qualifies under the contract, and the outcome ("running" until one is recorded).
Operators, the web UI and `torchpass incidents` find incidents by them; the dev server registers
them (`torchpass.ids`)."""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import SearchAttributeKey

with workflow.unsafe.imports_passed_through():
    from torchpass.ids import SA_JOB_ID, SA_KIND, SA_OUTCOME, SA_QUALIFYING

JOB_ID = SearchAttributeKey.for_keyword(SA_JOB_ID)
KIND = SearchAttributeKey.for_keyword(SA_KIND)
OUTCOME = SearchAttributeKey.for_keyword(SA_OUTCOME)
QUALIFYING = SearchAttributeKey.for_keyword(SA_QUALIFYING)
