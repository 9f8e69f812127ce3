"""The local directory of the checkpoint an engine serves, whether `model` is a path or an HF hub id.

Why: deltas are checked against the checkpoint's tensor names, shapes and dtypes, read from its
safetensors headers. For a hub id, vLLM has already fetched the weights into the HF cache before
any weight-transfer engine exists, so the snapshot is resolved from the cache only, never fetched.
"""

from __future__ import annotations

import os
from typing import Any


def local_checkpoint_dir(vllm_config: Any) -> str:
    """`model_config.model` if it is a directory, else its snapshot in the local HF cache."""
    model_config = vllm_config.model_config
    model = model_config.model
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(
        model,
        revision=model_config.revision,
        cache_dir=vllm_config.load_config.download_dir,
        local_files_only=True,
    )
