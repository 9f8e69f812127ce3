"""Runs at the start of every process of an engine started with harness.fp8_kernel.engine_env."""

from harness.fp8_kernel import install

install()
