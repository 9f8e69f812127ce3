"""A plain PyTorch trainer for the real-engine tests: transformers Llama from the served checkpoint,
AdamW at lr 1e-5, deterministic batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


class Trainer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        ids = torch.randint(3, 512, (2, 24), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live weights (no copy), as a sender takes them."""
        return ((n, p.detach()) for n, p in self.model.state_dict().items())

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the weights now."""
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}
