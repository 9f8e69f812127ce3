"""Worker bodies for tests/megatron/test_families.py (module-level, so `spawn` can import them)."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from harness import megatron_cpu
from hook_workers import LR, apply_entries, bits, tokens


def family_worker(rank, world, port, hf, tp, pp, steps, extra_args, vocab_multiple, trainer_padded, expect):
    """`steps` real steps; after each, every rank's shipped entries written into mbridge's previous
    export give its new export bit for bit, each changed element shipped exactly once.

    `trainer_padded`: the model is padded (`vocab_multiple`) as Megatron-LM / slime do, and the
    hook gets a bridge that knows nothing of it (`AutoBridge.from_config(cfg)`, as slime builds
    one); the reference export is the padding-aware bridge's. `expect`: HF names that must have
    been shipped at least once over all ranks (the MTP layer's, say)."""
    from mbridge import AutoBridge
    from transformers import AutoConfig

    from megatron_hook import register
    from vllm_delta import DeltaSender

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port, tp=tp, pp=pp)
    model, opt, gpt, ref = megatron_cpu.build_from_hf(
        hf, lr=LR, extra_args=extra_args, make_vocab_size_divisible_by=vocab_multiple
    )
    bridge = ref
    if trainer_padded:
        cfg = AutoConfig.from_pretrained(hf)
        cfg.rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters.get("rope_theta", 10000.0)
        bridge = AutoBridge.from_config(cfg)
        assert bridge.make_vocab_size_divisible_by is None and bridge.padded_vocab_size is None
    group = dist.new_group(backend="gloo")
    shipped: set[str] = set()
    with tempfile.TemporaryDirectory() as root:
        sender = DeltaSender([], "disk", root, group=group)
        handle = register(opt, [model], sender, bridge=bridge, checkpoint=hf)
        assert handle.seed_report.ok, handle.seed_report
        prev = megatron_cpu.export_hf(ref, gpt)
        for step in range(steps):
            if pp > 1:
                megatron_cpu.pipeline_step(model, opt, tokens(step))
            else:
                megatron_cpu.train_step(model, opt, tokens(step))
            handle.flush()
            mine = [(e.name, e.positions, e.new_values) for e in handle.last_capture.entries]
            every = [None] * world
            dist.all_gather_object(every, mine)
            new = megatron_cpu.export_hf(ref, gpt)  # mbridge's export, independent of the hook's map
            applied = apply_entries(prev, [e for part in every for e in part])  # asserts: no element twice
            bad = [n for n in new if not torch.equal(bits(applied[n]), bits(new[n]))]
            assert not bad, f"step {step}: shipped entries do not reproduce the export for {bad[:5]}"
            sent: dict[str, int] = {}
            for part in every:
                for name, pos, _ in part:
                    sent[name] = sent.get(name, 0) + pos.numel()
            changed = {n: int((bits(prev[n]) != bits(new[n])).sum()) for n in new}
            assert {n: c for n, c in sent.items() if c} == {n: c for n, c in changed.items() if c}, step
            shipped |= {n for n, c in sent.items() if c}
            prev = new
        handle.remove()
        sender.close()
    missing = set(expect) - shipped
    assert not missing, f"never shipped: {sorted(missing)}"
