"""Environment validation for YOCO opt-in: the checks, their verdicts and the report. Pure."""
