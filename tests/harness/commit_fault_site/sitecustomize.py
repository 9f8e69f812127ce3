"""Runs at the start of every process of an engine started with harness.commit_fault.engine_env."""

import os

if os.environ.get("VLLM_DELTA_TEST_FAULT_AT"):
    from harness.commit_fault import install

    install()
