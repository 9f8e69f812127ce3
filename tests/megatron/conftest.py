"""Megatron hook tests: skipped unless megatron-core and mbridge are installed."""

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
