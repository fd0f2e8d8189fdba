"""torchpass: live migration for distributed PyTorch training, orchestrated by Temporal.

This package is the shared domain core: pydantic models, the event-classification table, pure
decisions, ids and settings, and the CLI. It imports neither Temporal workers nor torch at import
time.
"""

__version__ = "0.1.0"
