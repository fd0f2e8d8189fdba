"""Test doubles for Kubernetes: a stub API server (stub_apiserver)."""
