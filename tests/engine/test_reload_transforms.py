"""vLLM's own in-place reload (`model_loader/reload/layerwise.py`) on modules with post-load transforms.

Why: with delta updates on, a module whose step empties its weight (the CPU repack) gets its
canonical tensor back as the live parameter; vLLM's layerwise reload then copied the re-run
step's empty result into it and crashed ("size of tensor a (128) must match ... (0)", found on
glm4_moe TP=2), and, run without our bookkeeping, would leave the canonical stash stale. Here
vLLM's real reload functions run on small modules whose quant methods are real
`QuantizeMethodBase`s (a repack that empties the weight and hides a packed copy, a step that
pads a weight to a new shape, a permutation and a derived tensor); afterwards a delta must be
bit-exact with a fresh load of the delta'd weights. The engine-level check is the bit-exact
matrix (tests/engine/test_apply_bitexact.py), which reloads every config.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_delta.engine.staging import flat_storage
from vllm_delta.engine.transforms import (
    canonical_tensors,
    install_reload_hooks,
    observing,
    offset_maps,
    rerun_unit,
    transformed,
)

pytest.importorskip("vllm")
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.model_loader.reload import layerwise  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402


class Step(QuantizeMethodBase):
    """A real quant method whose post-load step is `kind`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if self.kind == "repack":  # CPU oneDNN / sgl: a packed copy in a closure, the weight emptied
            packed = w.t().contiguous()
            layer.packed = lambda: packed
            layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        elif self.kind == "pad":  # CPU fused MoE: padded to a new shape
            layer.weight.data = torch.cat([w, torch.zeros_like(w[:1])])
        elif self.kind == "swap":  # FlashInfer-CUTLASS w13
            layer.weight.data = torch.cat([w[2:], w[:2]]).contiguous()
        elif self.kind == "derive":  # MLA's W_UV
            layer.W_UV = w.float().t().contiguous() * 2


class Layer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.quant_method = Step(kind)


KINDS = ["repack", "pad", "swap", "derive"]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({k: Layer(k) for k in KINDS})

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].weight_loader(params[name], w)
        return set(params)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{k}.weight": torch.randn(4, 3, generator=gen).to(torch.bfloat16) for k in KINDS}


def started(weights: dict[str, torch.Tensor]) -> Model:
    """Engine start as vLLM does it, with delta updates on: metadata, load, observed post-load loop."""
    model = Model()
    layerwise.record_metadata_for_reloading(model)
    model.load_weights(weights.items())
    with observing(model):
        for module in model.modules():
            if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
                module.quant_method.process_weights_after_loading(module)
    return model


def reload(model: Model, weights: dict[str, torch.Tensor]) -> None:
    """vLLM's `reload_weights(is_checkpoint_format=True)`, minus reading the files."""
    layerwise.initialize_layerwise_reload(model)
    model.load_weights(weights.items())
    layerwise.finalize_layerwise_reload(model, SimpleNamespace(dtype=torch.bfloat16))


def served(model: Model) -> dict[str, torch.Tensor]:
    """What each layer's forward would read."""
    layers = model.layers
    return {
        "repack": layers["repack"].packed(),
        "pad": layers["pad"].weight.data,
        "swap": layers["swap"].weight.data,
        "derive": layers["derive"].W_UV,
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [
        k
        for k in a
        if not (
            a[k].shape == b[k].shape
            and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        )
    ]


@pytest.fixture
def hooks(monkeypatch):
    """The reload hooks engine start installs (transforms.install), undone after the test."""
    stock(monkeypatch)
    install_reload_hooks()


def stock(monkeypatch) -> None:
    for name in ("_layerwise_process", "_copy_and_restore_kernel_tensors"):
        fn = getattr(layerwise, name)
        monkeypatch.setattr(layerwise, name, getattr(fn, "__wrapped__", fn))


def commit(model: Model, weights: dict[str, torch.Tensor]) -> None:
    """Write `weights` as a commit writes a delta: to the canonical targets, through a permutation's map."""
    targets = {n: canon for n, (_, canon) in canonical_tensors(model).items()}
    maps = offset_maps(model)
    for name, values in weights.items():
        flat = flat_storage(targets[name])
        at = torch.arange(values.numel()) + targets[name].storage_offset()
        flat[maps[name].live(at) if name in maps else at] = values.view(-1)


def rerun(model: nn.Module) -> None:
    """The touched "rerun" modules' steps re-run in place, as a commit does where no stand-in built them."""
    for m in model.modules():
        if (unit := rerun_unit(m)) is not None:
            unit.rederive()


def test_reload_then_delta_is_bitexact_with_a_fresh_load(hooks):
    base, final = checkpoint(0), checkpoint(1)
    model = started(final)
    assert transformed(model) == {
        "layers.pad": "rerun",
        "layers.swap": "permutation",
        "layers.derive": "rerun",
        "layers.repack": "rerun",
    }
    live_before = dict(model.named_parameters())
    stash_before = {k: (u := rerun_unit(model.layers[k])) and u.canonical.get("weight") for k in KINDS}

    reload(model, base)
    assert same(served(model), served(started(base))) == []
    # The live tensors and canonical stashes are the same objects (pointers kept), now at BASE.
    assert all(p is live_before[n] for n, p in model.named_parameters())
    for k, stash in stash_before.items():
        if stash is not None:
            assert rerun_unit(model.layers[k]).canonical["weight"] is stash
            assert torch.equal(stash, base[f"layers.{k}.weight"])

    # A delta after the reload, written as a commit writes it: to the canonical targets, through
    # the permutation's map, then the touched "rerun" modules re-run their step.
    commit(model, final)
    rerun(model)
    assert same(served(model), served(started(final))) == []
    assert torch.equal(
        model.layers["repack"].weight, final["layers.repack.weight"]
    )  # digests see real weights


def test_stock_reload_of_a_given_back_weight_is_the_reported_crash(monkeypatch):
    """Without the hooks, vLLM's reload copies the re-run step's empty weight into the canonical one."""
    stock(monkeypatch)
    model = started(checkpoint(1))
    with pytest.raises(RuntimeError, match="must match the size of tensor b \\(0\\)"):
        reload(model, checkpoint(0))


def pointers(model: nn.Module) -> dict[str, int]:
    """data_ptr of every tensor each module holds itself (params, buffers, tensor attributes)."""
    out = {}
    for name, m in model.named_modules():
        held = {
            **m._parameters,
            **m._buffers,
            **{k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)},
        }
        out.update({f"{name}.{k}": t.data_ptr() for k, t in held.items() if t is not None})
    return out


def test_a_refresh_keeps_every_tensor_where_it_was(hooks):
    """CUDA-graph safety: re-deriving after a delta writes into the storage the engine reads (no
    rebinding, no new Parameter, no reallocated derived tensor), for every kind of step."""
    model = started(checkpoint(0))
    before, objects = pointers(model), {n: p for n, p in model.named_parameters()}
    final = checkpoint(1)
    commit(model, final)
    rerun(model)
    assert same(served(model), served(started(final))) == []
    assert pointers(model) == before
    assert all(p is objects[n] for n, p in model.named_parameters())
    reload(model, checkpoint(2))  # vLLM's layerwise reload goes through the same refresh
    assert same(served(model), served(started(checkpoint(2)))) == []
    assert pointers(model) == before
