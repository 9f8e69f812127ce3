"""Worker bodies for the megatron hook tests (module-level, so `spawn` can import them)."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from harness import megatron_cpu

LR = 1e-2


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32}
    return t.detach().contiguous().view(ints[t.element_size()])


def tokens(step: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(1000 * step + ps.get_data_parallel_rank())
    return torch.randint(0, 512, (2, 17), generator=gen)


def apply_entries(prev: dict[str, torch.Tensor], entries: list) -> dict[str, torch.Tensor]:
    """The previous export with every rank's shipped (positions, values) written in."""
    out = {n: t.clone() for n, t in prev.items()}
    seen: dict[str, torch.Tensor] = {}
    for name, pos, vals in entries:
        flat = out[name].view(-1)
        flat[pos] = vals.to(flat.dtype)
        mark = seen.setdefault(name, torch.zeros(flat.numel(), dtype=torch.int32))
        mark[pos] += 1
    for name, mark in seen.items():
        assert int(mark.max()) <= 1, f"{name}: an element was shipped by two ranks"
    return out


def topology_worker(rank, world, port, hf, tp, ep, pp, distopt, steps, family, vocab_multiple=None):
    """`steps` real steps (through megatron's pipeline schedule at PP>1); after each, the union of
    every rank's shipped entries applied to mbridge's previous export equals its new export, each
    changed element is shipped exactly once, and each rank ships only what its stage/shard holds."""
    from megatron_hook import register
    from vllm_delta import DeltaSender

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port, tp=tp, ep=ep, pp=pp)
    # GLM4-MoE: the tiny checkpoint has no qkv bias; mbridge leaves the expert-bias update rate at 0.
    extra = dict(add_qkv_bias=False, moe_router_bias_update_rate=1e-2) if family == "glm4_moe" else None
    model, opt, gpt, bridge = megatron_cpu.build_from_hf(
        hf,
        lr=LR,
        use_distributed_optimizer=distopt,
        overlap_param_gather=distopt,
        extra_args=extra,
        make_vocab_size_divisible_by=vocab_multiple,
    )
    if ep > 1 and tp > 1:
        model.eval()  # MoE with TP>1 trains only with sequence parallel, which the local spec refuses
    pad = _padding_rows(gpt, bridge, tp) if vocab_multiple else None
    group = dist.new_group(backend="gloo")
    with tempfile.TemporaryDirectory() as root:
        sender = DeltaSender([], "disk", root, group=group)  # no engine: the entries are checked here
        handle = register(opt, [model], sender, bridge=bridge, checkpoint=hf)
        assert handle.seed_report.ok, handle.seed_report
        mayship = {s.name for s in handle.segments}
        if pp > 1:
            _assert_own_stage(gpt, mayship)
        if pad is not None:
            _assert_padding_unmapped(gpt, bridge, tp, handle.segments)
        prev = megatron_cpu.export_hf(bridge, gpt)
        total_changed = 0
        shipped: set[str] = set()
        for step in range(steps):
            if pp > 1:
                megatron_cpu.pipeline_step(model, opt, tokens(step))
            else:
                megatron_cpu.train_step(model, opt, tokens(step))
            handle.flush()
            assert handle.syncs == step + 1
            mine = [(e.name, e.positions, e.new_values) for e in handle.last_capture.entries]
            assert {e[0] for e in mine if e[1].numel()} <= mayship
            every = [None] * world
            dist.all_gather_object(every, mine)
            new = megatron_cpu.export_hf(bridge, gpt)  # mbridge's export, independent of our map
            assert set(new) == set(prev)
            applied = apply_entries(prev, [e for part in every for e in part])
            shipped |= {e[0] for part in every for e in part if e[1].numel()}
            bad = [n for n in new if not torch.equal(bits(applied[n]), bits(new[n]))]
            assert not bad, f"step {step}: shipped entries do not reproduce the export for {bad[:5]}"
            changed = {n: int((bits(prev[n]) != bits(new[n])).sum()) for n in new}
            sent: dict[str, int] = {}
            for part in every:
                for name, pos, _ in part:
                    sent[name] = sent.get(name, 0) + pos.numel()
            assert {n: c for n, c in sent.items() if c} == {n: c for n, c in changed.items() if c}, step
            total_changed += sum(changed.values())
            prev = new
        handle.remove()
        sender.close()
    assert total_changed > 0
    if pp > 1:  # both stages trained and shipped (the schedule carried gradients back to stage 0)
        stages = [None] * world
        dist.all_gather_object(stages, sorted(shipped & mayship))
        assert all(stages), stages
    if pad is not None:  # the padded rows trained (output-layer logits), so dropping them was tested
        rows, before = pad
        moved = int((bits(before) != bits(gpt.output_layer.weight[rows])).sum()) if rows.numel() else 0
        total = torch.tensor(moved)
        dist.all_reduce(total)
        assert int(total) > 0, "no padded row changed: the padding case tested nothing"
    if family == "glm4_moe":  # the fp32 router bias buffer moved and was shipped
        assert any(n.endswith("e_score_correction_bias") for n in shipped), sorted(shipped)


def _padding_rows(gpt, bridge, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local output-layer rows past the HF vocab, and their values now."""
    from megatron.core import parallel_state as ps

    assert bridge.padded_vocab_size > bridge.vocab_size, (bridge.padded_vocab_size, bridge.vocab_size)
    per = bridge.padded_vocab_size // tp
    first = ps.get_tensor_model_parallel_rank() * per
    rows = torch.arange(min(max(bridge.vocab_size - first, 0), per), per)
    return rows, bits(gpt.output_layer.weight[rows]).clone()


def _assert_padding_unmapped(gpt, bridge, tp: int, segments) -> None:
    """The vocab-parallel tensors' segments cover exactly this rank's real (HF) rows."""
    from megatron.core import parallel_state as ps

    per = bridge.padded_vocab_size // tp
    real = min(max(bridge.vocab_size - ps.get_tensor_model_parallel_rank() * per, 0), per)
    hidden = gpt.output_layer.weight.shape[1]
    for hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        covered = sum(s.tensor.numel() for s in segments if s.name == hf_name)
        assert covered == real * hidden, (hf_name, covered, real, hidden)


def _assert_own_stage(gpt, names: set[str]) -> None:
    """A pipeline stage may ship only its own layers, the embedding only on the first stage, and
    the final norm and lm_head only on the last."""
    import re

    layers = {layer.layer_number - 1 for layer in gpt.decoder.layers}  # global, 1-based in megatron
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m:
            assert int(m.group(1)) in layers, (n, layers)
        elif n == "model.embed_tokens.weight":
            assert gpt.pre_process, n
        else:
            assert gpt.post_process and n in ("model.norm.weight", "lm_head.weight"), n
    assert {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))} == layers


def behaviour_worker(rank, world, port, hf, expect_path):
    """Registration on a model one element off the checkpoint, a skipped step, and remove()."""
    import json

    from megatron_hook import register
    from vllm_delta import DeltaSender

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port)
    model, opt, gpt, bridge = megatron_cpu.build_from_hf(hf, lr=LR, loss_scale=1.0)
    # One bf16 element of the trainer's weights one ULP off the served checkpoint.
    qkv = gpt.decoder.layers[1].self_attention.linear_qkv.weight
    with torch.no_grad():
        qkv.view(-1).view(torch.int16)[77] += 1
    # Where that element is in HF coordinates, by mbridge's export (not by the hook's map).
    from safetensors.torch import load_file

    served = load_file(f"{hf}/model.safetensors")
    exported = megatron_cpu.export_hf(bridge, gpt)
    expect = {
        n: torch.nonzero(bits(exported[n]).view(-1) != bits(served[n]).view(-1)).view(-1).tolist()
        for n in served
    }
    expect = {n: p for n, p in expect.items() if p}
    assert sum(len(p) for p in expect.values()) == 1, expect

    with tempfile.TemporaryDirectory() as root:
        sender = DeltaSender([], "disk", root)
        syncs: list[dict] = []
        # By default a mismatch stops registration on every rank, naming the element.
        import pytest

        from megatron_hook import SeedMismatchError

        with pytest.raises(
            SeedMismatchError, match=r"1 elements .*'model\.layers\.1\.self_attn\.q_proj\.weight': \[77\]"
        ):
            register(opt, [model], sender, bridge=bridge, checkpoint=hf)
        assert "step" not in vars(opt), "a refused register() must leave the optimizer alone"
        with pytest.raises(ValueError, match="seed_from_trainer=True"):
            register(opt, [model], sender, bridge=bridge)  # no checkpoint, no explicit opt-out
        handle = register(
            opt, [model], sender, bridge=bridge, checkpoint=hf, seed_mismatch="warn", on_sync=syncs.append
        )
        got = {n: p.tolist() for n, p in handle.seed_report.mismatches.items()}
        assert handle.seed_report.total == 1 and got == expect, (got, expect)

        # A step whose gradients are not finite: megatron's loss scaler skips it; no sync.
        before = {n: bits(p).clone() for n, p in gpt.named_parameters()}
        version = sender.version
        ok = _step(model, opt, tokens(0), scale=float("inf"))
        assert not ok and handle.skipped == 1 and handle.syncs == 0 and sender.version == version
        assert all(torch.equal(before[n], bits(p)) for n, p in gpt.named_parameters())

        assert _step(model, opt, tokens(1)) and handle.syncs == 1
        handle.remove()
        assert len(syncs) == 1 and syncs[0]["sender/changed_elements"] > 0, syncs
        assert "step" not in vars(opt) and opt.step.__func__ is type(opt).step
        assert _step(model, opt, tokens(2)) and handle.syncs == 1  # removed: no sync
        sender.close()
    with open(expect_path, "w") as f:
        json.dump(expect, f)


def _step(model, opt, toks: torch.Tensor, scale: float = 1.0) -> bool:
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    opt.zero_grad()
    inp, labels = toks[:, :-1], toks[:, 1:]
    pos = torch.arange(inp.shape[1]).unsqueeze(0).expand_as(inp)
    loss = model(inp, pos, None, labels=labels).float().mean() * scale
    loss.backward()
    finalize_model_grads([model])
    ok, _, _ = opt.step()
    return bool(ok)


def engine_worker(rank, world, port, hf, url, root, api_key, signing_key, version, steps, out):
    """TP=2 x EP=2: the hook pushes signed disk deltas to a real engine; rank 0 writes mbridge's export."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from megatron_hook import register
    from vllm_delta import DeltaSender

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port, tp=2, ep=2)
    model, opt, gpt, bridge = megatron_cpu.build_from_hf(hf, lr=LR)
    model.eval()  # MoE with TP>1 trains only with sequence parallel, which the local spec refuses
    group = dist.new_group(backend="gloo")
    sender = DeltaSender(
        [url],
        "disk",
        root,
        api_key=api_key,
        group=group,
        version=version,
        flush_bytes=64 << 10,
        signing_keys=[signing_key],  # rank 0 signs the merged manifest
    )
    synced: list[dict] = []
    handle = register(opt, [model], sender, bridge=bridge, checkpoint=hf, on_sync=synced.append)
    assert handle.seed_report.ok, handle.seed_report
    for step in range(steps):
        megatron_cpu.train_step(model, opt, tokens(step))
    handle.remove()
    assert len(synced) == steps and all(m["sender/all_acked"] == 1.0 for m in synced), synced
    sender.close()
    final = megatron_cpu.export_hf(bridge, gpt)
    if rank == 0:
        dest = Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        for f in Path(hf).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and "index" not in f.name:
                shutil.copy2(f, dest / f.name)
        save_file({n: t.contiguous() for n, t in final.items()}, dest / "model.safetensors")


def rebind_worker(rank, world, port, hf):
    """An offload/onload cycle after register() (every `param.data` rebound to new memory): the next
    sync still ships exactly the elements mbridge's export shows changed; a weight rebound with
    another layout stops the sync, naming the weight."""
    import pytest

    from megatron_hook import RebindError, register
    from vllm_delta import DeltaSender

    megatron_cpu.import_mbridge()
    megatron_cpu.init_distributed(rank, world, port)
    model, opt, gpt, bridge = megatron_cpu.build_from_hf(hf, lr=LR)
    with tempfile.TemporaryDirectory() as root:
        sender = DeltaSender([], "disk", root)  # no engine: the entries are checked here
        handle = register(opt, [model], sender, bridge=bridge, checkpoint=hf)
        for step in range(2):
            prev = megatron_cpu.export_hf(bridge, gpt)
            with torch.no_grad():  # offload, then onload into fresh memory
                for p in gpt.parameters():
                    p.data = p.data.clone()
            megatron_cpu.train_step(model, opt, tokens(step))
            handle.flush()
            new = megatron_cpu.export_hf(bridge, gpt)  # mbridge's export, independent of our map
            shipped = [(e.name, e.positions, e.new_values) for e in handle.last_capture.entries]
            applied = apply_entries(prev, shipped)
            changed = sum(int((bits(prev[n]) != bits(new[n])).sum()) for n in new)
            assert changed > 0 and sum(e[1].numel() for e in shipped) == changed, (step, changed)
            bad = [n for n in new if not torch.equal(bits(applied[n]), bits(new[n]))]
            assert not bad, f"step {step}: shipped entries miss the rebound weights' changes: {bad[:5]}"
        w = gpt.decoder.layers[0].mlp.linear_fc1.weight
        with torch.no_grad():  # same values, column-major: the segment views cannot follow
            w.data = w.data.t().contiguous().t()
        with pytest.raises(RebindError, match=r"decoder\.layers\.0\.mlp\.linear_fc1\.weight was rebound"):
            megatron_cpu.train_step(model, opt, tokens(9))
        sender.close()
