"""The workflows' logger: Temporal's workflow logger (quiet on replay, the run's details attached),
with those details escaped where they are appended to the message.

The SDK appends the workflow's details to the format string itself, so a workflow id holding a `%`
(an incident's failure domain is percent-encoded in it: `vm%2Frank0-1`) makes the record's
formatting fail: the line is lost in production, and under pytest, which re-raises logging errors,
the workflow task fails with it.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from temporalio import workflow


class _EscapedDetails(workflow.LoggerAdapter):
    def __init__(self) -> None:
        super().__init__(logging.getLogger("temporalio.workflow"), None)
        self.workflow_info_on_message = False  # appended below, escaped
        self.workflow_info_on_extra = True

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        details = (kwargs.get("extra") or {}).get("temporal_workflow")
        if details:
            msg = f"{msg} ({str(details).replace('%', '%%')})"
        return msg, kwargs


logger = _EscapedDetails()
