"""TORCHPASS_BILLING_*: where credit notices go. A section of the control worker's
`workers.settings`."""

from __future__ import annotations

from pydantic import AnyHttpUrl, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from torchpass.contract.billing import DEFAULT_SIGNAL_NAME
from torchpass.policies import MAX_WEBHOOK_TIMEOUT_S


class BillingSettings(BaseSettings):
    """Validated once when the control worker starts."""

    model_config = SettingsConfigDict(env_prefix="TORCHPASS_BILLING_", extra="ignore")

    webhook_url: AnyHttpUrl | None = Field(
        default=None, description="where credit notices are POSTed"
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="HMAC key shared with the receiver"
    )
    timeout: float = Field(
        default=10.0, gt=0, le=MAX_WEBHOOK_TIMEOUT_S, description="seconds per attempt"
    )
    workflow_id: str | None = Field(
        default=None, description="billing's own Temporal workflow to signal"
    )
    signal_name: str = Field(default=DEFAULT_SIGNAL_NAME, min_length=1)

    @model_validator(mode="after")
    def _secret_with_url(self) -> BillingSettings:
        if self.webhook_url is not None and not (
            self.webhook_secret and self.webhook_secret.get_secret_value()
        ):
            raise ValueError(
                "TORCHPASS_BILLING_WEBHOOK_SECRET is required when a webhook URL is set"
            )
        return self

    @property
    def configured(self) -> bool:
        return self.webhook_url is not None or self.workflow_id is not None
