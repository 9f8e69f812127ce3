"""Tensors the probe cannot map are served by replaying their own loader on a checkpoint shadow.

Loaders here: one scales its input (a value transform the probe refuses to map), one takes a
cumulative sum (each element depends on many), and three that cannot be replayed exactly: one
fills the parameter in place first, one adds a call counter (not deterministic), and one whose
live weight a post-load step changed. Every check runs in prepare, before any write; the commit
is a plain scatter that never calls the loader; the replayed tensors carry digests like any other.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from harness.synthetic import InProcessEngine, LocalWorker, device_check
from safetensors.torch import save_file
from torch import nn

from vllm_delta.engine.apply import DeltaApplier
from vllm_delta.engine.digests import check_partials
from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater, guard_health
from vllm_delta.wire.additive import tensor_sum, to_hex
from vllm_delta.wire.errors import IncompatibleDeltaError, IntegrityError

H = 8
SERVED = ("plain.weight", "scaled.weight", "cumsum.weight")
REFUSED = ("filled.weight", "counted.weight", "relaid.weight")
CHECKPOINT = {n: ((H, H), torch.bfloat16) for n in SERVED + REFUSED}


class OddLoaders(nn.Module):
    """One plain copy and five loaders the probe cannot map; `relaid` is changed after loading."""

    def __init__(self, served_only: bool = False) -> None:
        super().__init__()
        self.names = SERVED if served_only else SERVED + REFUSED
        for n in self.names:
            self.register_parameter(
                n.split(".")[0], nn.Parameter(torch.zeros(H, H, dtype=torch.bfloat16), requires_grad=False)
            )
        self.calls = 0

    def load_weights(self, weights) -> None:
        for name, w in weights:
            p = getattr(self, name.split(".")[0]).data
            if name == "plain.weight":
                p.copy_(w)
            elif name in ("scaled.weight", "relaid.weight"):
                p.copy_(w * 2)
            elif name == "cumsum.weight":
                p.copy_(w.float().cumsum(0))
            elif name == "filled.weight":
                p.fill_(0)
                p[:] = w
            elif name == "counted.weight":
                self.calls += 1
                p.copy_(w + self.calls)

    def post_load(self) -> None:
        if "relaid.weight" in self.names:
            self.relaid.data.copy_(self.relaid.data.t().clone())


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in CHECKPOINT.items()}


def loaded(ckpt: dict[str, torch.Tensor], served_only: bool = False) -> OddLoaders:
    m = OddLoaders(served_only)
    m.load_weights((n, t) for n, t in ckpt.items() if n in m.names)
    m.post_load()
    return m


def step(ckpt: dict[str, torch.Tensor], seed: int, names=SERVED) -> dict[str, torch.Tensor]:
    """A quarter of each of `names`' elements moved by a few ULPs."""
    g = torch.Generator().manual_seed(seed)
    out = dict(ckpt)
    for n in names:
        t = ckpt[n].clone()
        bits = t.view(-1).view(torch.int16)
        bits[torch.rand(bits.shape, generator=g) < 0.25] += torch.randint(1, 4, (), generator=g).to(
            torch.int16
        )
        out[n] = t
    return out


def write_delta(path, old, new, *, version=1, encoding="ulp_zstd"):
    """With additive pre/post digests of the full tensors, as a sender writes them."""
    device_check().write_delta(path, old, new, version=version, encoding=encoding)
    return path


def applier(m: OddLoaders, ckpt: dict[str, torch.Tensor]) -> DeltaApplier:
    names = {n: CHECKPOINT[n] for n in m.names}
    return DeltaApplier(m, names, read=lambda n: ckpt[n].clone())


def same_bits(a: nn.Module, b: nn.Module) -> list[str]:
    return [
        n
        for n, p in a.named_parameters()
        if not torch.equal(p.view(torch.int16), getattr(b, n).view(torch.int16))
    ]


def test_loaders_that_cannot_be_replayed_exactly_are_refused_at_startup():
    base = checkpoint(0)
    a = applier(loaded(base), base)
    status = (a.placements, a.placement_status())[1]
    assert set(status["fallback"]) == {"scaled.weight", "cumsum.weight", *REFUSED}
    assert sorted(status["refused"]) == sorted(REFUSED)
    assert "in place" in status["refused"]["filled.weight"]
    assert "not deterministic" in status["refused"]["counted.weight"]
    assert "does not give the loaded relaid" in status["refused"]["relaid.weight"]


@pytest.mark.parametrize("encoding", ["ulp_zstd", "indices"])
def test_replayed_tensors_apply_bitexact_and_carry_digests(tmp_path, encoding):
    base = checkpoint(0)
    m = loaded(base, served_only=True)
    a = applier(m, base)
    new = step(base, seed=1)
    newer = step(new, seed=2)
    for version, (old, want) in enumerate([(base, new), (new, newer)], start=1):
        staged = a.prepare(
            write_delta(tmp_path / f"v{version}", old, want, version=version, encoding=encoding),
            version=version,
            base_version=version - 1,
            current_version=version - 1,
        )
        assert staged.fallback_names == ["cumsum.weight", "scaled.weight"]
        check_partials(
            [{"digests": staged.digests, "expected": staged.expected}]
        )  # pre and post, counted here
        assert all(None not in staged.digests[n] for n in ("scaled.weight", "cumsum.weight"))
        a.commit(staged)
        assert same_bits(m, loaded(want, served_only=True)) == []  # the second proves the shadow advanced


def test_genuine_nan_reaches_a_replayed_tensor(tmp_path):
    """vLLM's NaN-masked loader cannot carry a real NaN; the replay can."""
    base = checkpoint(0)
    m = loaded(base, served_only=True)
    a = applier(m, base)
    new = dict(base, **{"scaled.weight": base["scaled.weight"].clone()})
    new["scaled.weight"][2, 3] = float("nan")
    staged = a.prepare(
        write_delta(tmp_path / "v1", base, new, encoding="indices"),
        version=1,
        base_version=0,
        current_version=0,
    )
    a.commit(staged)
    assert torch.isnan(m.scaled[2, 3]) and same_bits(m, loaded(new, served_only=True)) == []


def test_every_check_runs_in_prepare_and_the_commit_never_calls_the_loader(tmp_path):
    base = checkpoint(0)
    m = loaded(base, served_only=True)
    a = applier(m, base)
    new = step(base, seed=3)
    delta = write_delta(tmp_path / "v1", base, new)
    assert a.placements and a.refused == {}  # startup: the shadows reproduce the live weights
    # The live scaled weight drifted from what its loader makes of the checkpoint: refused in
    # prepare, naming it, and no weight (not even the plain one listed first) was written.
    m.scaled.data.view(torch.int16)[0, 0] += 1
    before = {n: p.clone() for n, p in m.named_parameters()}
    with pytest.raises(IntegrityError) as err:
        a.prepare(delta, version=1, base_version=0, current_version=0)
    assert err.value.param == "scaled.weight" and "pre-apply" in err.value.reason
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    m.scaled.data.view(torch.int16)[0, 0] -= 1
    staged = a.prepare(delta, version=1, base_version=0, current_version=0)

    def no_loader(weights):
        raise AssertionError("the commit called the loader")

    m.load_weights = no_loader
    a._load_weights = no_loader
    a.commit(staged)
    assert same_bits(m, loaded(new, served_only=True)) == []


def test_full_verify_covers_replayed_tensors(tmp_path):
    """The whole-tensor digest of a replayed tensor is its shadow's, and live drift breaks it."""
    base = checkpoint(0)
    m = loaded(base, served_only=True)
    a = applier(m, base)
    new = step(base, seed=6)
    a.commit(a.prepare(write_delta(tmp_path / "v1", base, new), version=1, base_version=0, current_version=0))
    for name in ("scaled.weight", "cumsum.weight"):
        assert a.whole_partial(name) == to_hex(tensor_sum(new[name]))
    m.cumsum.data.view(torch.int16)[3, 1] += 1
    assert a.whole_partial("cumsum.weight") != to_hex(tensor_sum(new["cumsum.weight"]))


def test_a_delta_for_a_refused_tensor_is_refused_before_any_write(tmp_path):
    base = checkpoint(0)
    m = loaded(base)
    a = applier(m, base)
    new = step(base, seed=4, names=("plain.weight", "filled.weight"))
    before = {n: p.clone() for n, p in m.named_parameters()}
    with pytest.raises(IncompatibleDeltaError) as err:
        a.prepare(write_delta(tmp_path / "v1", base, new), version=1, base_version=0, current_version=0)
    assert err.value.param == "filled.weight" and "in place" in err.value.reason
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_server_with_a_refused_loader_fails_health_and_refuses_updates(tmp_path):
    base = checkpoint(0)
    (tmp_path / "model").mkdir()
    save_file(base, str(tmp_path / "model" / "model.safetensors"))
    (tmp_path / "root").mkdir()
    updater = DeltaUpdater(
        InProcessEngine([LocalWorker(loaded(base), tmp_path / "model", 0)]), tmp_path / "root", 1 << 20, []
    )
    app = FastAPI()
    app.get("/health")(lambda: {})
    guard_health(app)
    app.state.delta_updater = updater
    health = TestClient(app)
    assert health.get("/health").status_code == 200

    async def probe() -> dict:
        updater.start_probe()
        await updater._probe
        return await updater.status()

    status = asyncio.run(probe())
    assert sorted(status["placement"]["refused"]) == sorted(REFUSED) and not status["healthy"]
    reply = health.get("/health")
    assert reply.status_code == 503 and sorted(reply.json()["error"]["refused"]) == sorted(REFUSED)
    write_delta(tmp_path / "root" / "v1", base, step(base, seed=5, names=("plain.weight",)))
    with pytest.raises(UpdateError) as err:
        asyncio.run(updater.update(DeltaUpdateRequest(path="v1", version=1, base_version=0)))
    assert err.value.status == 500 and err.value.error["type"] == "UnservableLoader"
