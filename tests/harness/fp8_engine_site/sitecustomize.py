"""Runs at the start of every process of an engine started with harness.fp8_engine.engine_env."""

from harness import fp8_inspect, fp8_kernel

fp8_kernel.install()
fp8_inspect.install()
