"""Fixtures for the object-store transport tests: the session's local S3 store (harness/s3_server.py)."""

from harness.s3_server import s3_env, s3_server  # noqa: F401  (fixtures)
