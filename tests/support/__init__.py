"""Helpers shared by the test packages and their worker processes (importable as `support.*`)."""
