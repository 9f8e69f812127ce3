"""Sharded senders and capture/publish against a real `vllm serve` (CPU), bit-exact with a fresh engine.

2 and then 4 gloo ranks each hold TP-style slices of the same HF tensors: row slices (q, gate, up,
embeddings), column slices (o, down), interleaved row groups (k, v), norms on rank 0 only. Each rank
seeds its snapshot from the served checkpoint at its own placement, moves its slices like an
optimizer would, and syncs; rank 0 merges and pushes. The test assembles the ranks' final slices
with torch slicing (not with the sender's placement code) into the trainer's full weights. Then a
transformers trainer syncs with capture/publish overlapping its next step. Finally vLLM's own
loader, loading the final weights afresh (harness/fresh_load), must give the same digests as the
synced engine's `/weight_checker`. The engine is the session's shared Llama engine, put back on its
checkpoint when the module starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import megatron_cpu
from harness.engine_pool import API_KEY, reset_to_checkpoint
from safetensors.torch import load_file, save_file
from sender_helpers import engine_checksums, engine_status

from vllm_delta import DeltaSender

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
STEPS = 3


def _spans(
    name: str, shape: tuple[int, ...], rank: int, world: int
) -> tuple[int, list[tuple[int, int]]] | None:
    """This rank's (dim, spans) of an HF tensor, as a TP trainer would hold it; None: not held."""
    if len(shape) == 1:
        return (0, [(0, shape[0])]) if rank == 0 else None  # replicated across TP: one rank ships
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        g = shape[0] // (2 * world)  # interleaved groups: rank r holds groups r and r + world
        return 0, [(rank * g, g), ((rank + world) * g, g)]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        n = shape[1] // world
        return 1, [(rank * n, n)]
    n = shape[0] // world
    return 0, [(rank * n, n)]


def _worker(
    rank: int, world: int, port: int, url: str, root: str, state_dir: str, out: str, version: int
) -> None:
    import torch.distributed as dist
    from sender_helpers import adam_like_step

    from vllm_delta.sender import Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # the sender's own group (sender/publisher.py: Ranks)
    full = load_file(Path(state_dir) / "model.safetensors")
    shards = []
    for name, t in full.items():
        held = _spans(name, tuple(t.shape), rank, world)
        if held is not None:
            dim, spans = held
            # The trainer's own slices; the checkpoint seeds the snapshot at the same placement.
            local = torch.cat([t.narrow(dim, a, n) for a, n in spans], dim=dim).clone()
            shards.append(Shard.pieces(name, local, t.shape, dim, spans))
    sender = DeltaSender(
        [url], "disk", root, api_key=API_KEY, flush_bytes=16 << 10, version=version, group=group
    )
    sender.seed_from_checkpoint(state_dir, like=shards)
    gen = torch.Generator().manual_seed(100 * world + rank)
    for _ in range(STEPS):
        adam_like_step({s.name: s.tensor for s in shards}, gen, density=0.03)
        m = sender.sync(shards)
        assert m["sender/all_acked"] == 1.0, sender.engines
        assert m["sender/changed_elements"] > 0
    torch.save([(s.name, s.dim, s.spans, s.tensor) for s in shards], Path(out) / f"rank{rank}.pt")
    sender.close()
    dist.barrier()


def _assemble(state_dir: Path, out: Path, world: int, dest: Path) -> None:
    """The new full weights from every rank's slices, by torch slicing alone."""
    full = load_file(state_dir / "model.safetensors")
    for r in range(world):
        for name, dim, spans, local in torch.load(out / f"rank{r}.pt"):
            off = 0
            for a, n in spans:
                full[name].narrow(dim, a, n).copy_(local.narrow(dim, off, n))
                off += n
    _write_model(state_dir, full, dest)


def _write_model(like: Path, weights: dict[str, torch.Tensor], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dest / f.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, dest / "model.safetensors")


def status(server) -> dict:
    return engine_status(server.url, API_KEY)


def checksums(server) -> dict[str, str]:
    return engine_checksums(server.url, API_KEY)


@pytest.fixture(scope="module")
def root(engine_pool) -> Path:
    return engine_pool.delta_root()


@pytest.fixture(scope="module")
def server(engine_pool, tiny_model_factory, root):
    """The session's shared Llama delta engine, back on its checkpoint (where the ranks' slices start)."""
    s = engine_pool.shared_llama(tiny_model_factory("llama"))
    reset_to_checkpoint(s, root, tiny_model_factory("llama"))
    return s


def _sharded_phase(world: int, server, root: Path, state: Path, tmp_path: Path) -> Path:
    version = status(server)["version"]
    out = tmp_path / f"slices{world}"
    out.mkdir()
    megatron_cpu.spawn(_worker, world, server.url, str(root), str(state), str(out), version, timeout=300)
    s = status(server)
    assert s["version"] == version + STEPS and s["healthy"], s
    _assemble(state, out, world, tmp_path / f"state{world}")
    return tmp_path / f"state{world}"


def _capture_publish_phase(server, root: Path, state: Path, tmp_path: Path) -> Path:
    """A transformers trainer: capture after each step, publish in the background, train on."""
    from transformers import LlamaForCausalLM

    version = status(server)["version"]
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(state, torch_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    sender = DeltaSender([server.url], "disk", root, api_key=API_KEY, flush_bytes=64 << 10, version=version)
    sender.seed_from_checkpoint(state)
    waited_s = 0.0
    for step in range(1, 5):
        ids = torch.randint(3, 512, (2, 24), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sender.capture(model.state_dict())  # returns once the optimizer may touch the weights again
        waited_s += sender.last_wait_s
        assert status(server)["version"] == version + step - 1  # the previous publish had finished
        sender.publish()
    m = sender.wait()
    assert m["sender/all_acked"] == 1.0 and status(server)["version"] == version + 4
    print(
        f"capture/publish: waited {waited_s:.2f} s in capture() over 4 steps; "
        f"last publish took {m['perf/update_weights_time']:.2f} s"
    )
    sender.close()
    _write_model(state, model.state_dict(), tmp_path / "state_cp")
    return tmp_path / "state_cp"


def test_sharded_and_overlapped_syncs_equal_a_fresh_engine(
    server, root, tiny_model_factory, tmp_path, fresh_loader
):
    state = tiny_model_factory("llama")
    initial = checksums(server)
    for world in (2, 4):
        state = _sharded_phase(world, server, root, state, tmp_path)
    state = _capture_publish_phase(server, root, state, tmp_path)
    synced = checksums(server)
    assert synced != initial
    assert fresh_loader.checksums(state) == synced  # vLLM's own loader on the final weights
