"""Test-only CPU/gloo shim for megatron-core 0.16 (never import from product code).

megatron-core hard-codes CUDA in many places. `install()` redirects exactly the
usages a tiny GPTModel + DDP + megatron optimizer step hits on a CPU-only torch
build; each patch below says why it is needed. Call it (via `init_distributed`)
inside each worker process, never in the pytest process itself.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(dev) -> bool:
    return (isinstance(dev, torch.device) and dev.type == "cuda") or (
        isinstance(dev, str) and dev.startswith("cuda")
    )


class _CudaToCpu(TorchFunctionMode):
    """One torch-function mode instead of patching each megatron call site:

    - `device="cuda"` kwargs on tensor factories -> CPU (e.g. `_scale_one` in
      Float16OptimizerWithFloat16Params, the norm buffers in optimizer/clip_grads.py, the
      default causal mask in transformer/utils.py);
    - `tensor.cuda()` -> the tensor itself;
    - `tensor.type()` (no args) reports "torch.cuda.<X>Tensor": the bf16 optimizer and the
      distributed optimizer reject any param whose type() is not 'torch.cuda.{BFloat16,Half,
      Float}Tensor', and clip_grads asserts grad.type() == 'torch.cuda.FloatTensor'.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:  # an MTP stage's embedding copy (language_module.py)
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


class _NoStream:
    """Stand-in for a CUDA stream/event: every method is a no-op returning another _NoStream
    (so `stream.record_event().synchronize()` works); also usable as a context manager."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: _NoStream()


_INSTALLED = False


def install() -> None:
    """Apply all patches in this process (idempotent). Each is needed by at least one of the
    smoke configurations (TP=1/2, DP=2 + distributed optimizer + overlap_param_gather, EP=2
    MoE, PP=2 through the pipeline schedule); removing any one of them breaks that configuration."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # Dozens of sites do `device=torch.cuda.current_device()` (tensor_parallel layers/mappings,
    # DDP param/grad buffers, rotary embedding, ...), which raises on a CPU build.
    torch.cuda.current_device = lambda: _CPU
    # The MoE alltoall token dispatcher creates a side stream in MoELayer.__init__ and uses
    # torch.cuda.current_stream()/stream()/record_event().synchronize() for its D2H copies.
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: _NoStream()
    # The pipeline p2p layer synchronizes the device after its shape and tensor exchanges; on CPU
    # every gloo op has completed by then.
    torch.cuda.synchronize = lambda *a, **k: None
    # RNG tracker: model_parallel_cuda_manual_seed/CudaRNGStatesTracker.add read and seed the
    # CUDA generator, and fork() (entered by every attention forward for dropout, even at
    # p=0) gets/sets it. Back them with the CPU generator; seeding it keeps each tracker
    # state distinct (e.g. per-TP-rank dropout), as on GPU.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # MoE router: without Transformer Engine, moe_utils never defines `te_general_gemm`, yet
    # RouterGatingLinearFunction tests `te_general_gemm is not None` -> NameError (0.16 bug).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # The MoE alltoall dispatcher passes split sizes as tensors; gloo's all_to_all_single
    # binding accepts only int sequences -> convert with .tolist().
    a2a = torch.distributed.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        def as_list(s):
            return s.tolist() if hasattr(s, "tolist") else s

        return a2a(output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw)

    torch.distributed.all_to_all_single = all_to_all_single
    # Without Transformer Engine, megatron-core's TE extension hands out MagicMock stand-ins, so
    # multi_latent_attention's import succeeds with HAVE_TE = True and its
    # `isinstance(self.linear_proj, TELinear)` raises TypeError when building MLA.
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False
    # device="cuda" literals and tensor.type() checks: see _CudaToCpu. Entered for the rest of
    # the process (the mode stack is per thread; CPU autograd runs on the calling thread).
    _CudaToCpu().__enter__()


# --------------------------------------------------------------------------- helpers


def init_distributed(
    rank: int, world_size: int, port: int, tp: int = 1, ep: int = 1, pp: int = 1, seed: int = 1234
) -> None:
    """gloo process group + megatron parallel_state + RNG tracker, with the shim installed."""
    install()
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)  # identical on all ranks
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    query_groups: int = 2,
    vocab: int = 256,
    seq_len: int = 32,
    num_experts: int | None = None,
    lr: float = 1e-3,
    use_distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
):
    """Tiny bf16 GPTModel (local spec: RMSNorm, GQA, SwiGLU, RoPE, untied output layer),
    wrapped as Megatron-LM does (Float16Module, then DDP), plus its megatron Adam optimizer.
    Returns (ddp_model, optimizer, gpt_model); gpt_model.named_parameters() gives the
    un-prefixed megatron names (the DDP model prefixes them with "module.module.").
    `overlap_param_gather` also turns on overlap_grad_reduce (megatron requires both); then
    only this DP rank's shard is current after `optimizer.step()` until
    `ddp_model.start_param_sync(force_sync=True)` or the next forward. No pipeline stages."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    assert parallel_state.get_pipeline_model_parallel_world_size() == 1, "pp > 1 unsupported"
    moe = {}
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_ffn_hidden_size=hidden * 2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
        )
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=query_groups,
        ffn_hidden_size=hidden * 2,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        sequence_parallel=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **moe,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=seq_len,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_param_gather,
        overlap_param_gather=overlap_param_gather,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            bf16=True,
            lr=lr,
            weight_decay=0.0,
            clip_grad=1.0,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [model],
    )
    return model, opt, gpt


def train_step(model, opt, tokens: torch.Tensor) -> float:
    """One forward/backward/optimizer step on `tokens` [b, s+1]; returns the local loss."""
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    opt.zero_grad()
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(inp.shape[1]).unsqueeze(0).expand_as(inp)
    loss = model(inp, pos, None, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([model])
    ok, _grad_norm, _ = opt.step()
    assert ok, "megatron optimizer skipped the step"
    return loss.item()


def pipeline_step(model, opt, tokens: torch.Tensor, microbatches: int = 2) -> None:
    """One optimizer step through megatron-core's own forward-backward schedule
    (`get_forward_backward_func`: 1F1B with p2p activations/gradients between pipeline stages,
    over gloo here). `tokens` [b, s+1] is split into `microbatches`; every stage gets the same
    tokens (the first uses the inputs, the last the labels). Grads are finalized by megatron's
    `finalize_model_grads` (DP reduce, PP embedding sync) from inside the schedule."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    mb = inp.shape[0] // microbatches
    batches = iter([(inp[i * mb : (i + 1) * mb], labels[i * mb : (i + 1) * mb]) for i in range(microbatches)])

    def forward_step(data_iterator, chunk):
        x, y = next(data_iterator)
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
        out = chunk(x, pos, None, labels=y)

        def loss_func(per_token: torch.Tensor):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    model.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=microbatches,
        seq_length=inp.shape[1],
        micro_batch_size=mb,
        forward_only=False,
    )
    ok, _grad_norm, _ = opt.step()
    assert ok, "megatron optimizer skipped the step"


# --------------------------------------------------------------------------- spawn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every megatron rank imports before the shim (`import_mbridge`: mbridge pulls in megatron-core and
# transformers), about 6 s of CPU a rank here. `spawn` starts ranks from a forkserver that imported these
# once (the first `spawn` of a pytest process starts it), so each rank forks with them loaded instead of
# importing them again: the suite spawns about 30 megatron ranks. Imports only, no patch: the shim is
# installed in each rank (`init_distributed`), as before.
PRELOAD = [
    "harness.megatron_cpu",
    "mbridge",
    "mbridge.models.deepseek_v3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "megatron_hook",
    "vllm_delta",
]


def _entry(rank, fn, world_size, port, errq, args, environ):
    # The forkserver's environment is the one it started with: give the rank the caller's, as a spawned
    # process would have it.
    os.environ.clear()
    os.environ.update(environ)
    try:
        fn(rank, world_size, port, *args)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 300) -> None:
    """Run fn(rank, world_size, port, *args) in `world_size` new processes (fn must be importable,
    i.e. module-level), forked from a process that holds only `PRELOAD`'s imports. Any worker failure
    raises here with its traceback."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (this process's first spawn)
    errq = ctx.SimpleQueue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, port, errq, args, environ), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while any(p.is_alive() for p in procs) and failure is None:
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout}s"
            elif not errq.empty():
                rank, trace = errq.get()
                failure = f"rank {rank} failed:\n{trace}"
            elif any(p.exitcode not in (None, 0) for p in procs):
                failure = f"exit codes {[p.exitcode for p in procs]}"
            else:
                time.sleep(0.05)
    finally:
        for p in procs:  # a failed rank leaves its peers blocked in a collective
            if failure is not None and p.is_alive():
                p.terminate()
            p.join(10)
    if failure is None and not errq.empty():
        rank, trace = errq.get()
        failure = f"rank {rank} failed:\n{trace}"
    if failure is None and any(p.exitcode != 0 for p in procs):
        failure = f"exit codes {[p.exitcode for p in procs]}"
    if failure is not None:
        raise RuntimeError(f"megatron worker failure: {failure}")


# --------------------------------------------------------------------------- mbridge on CPU


def build_from_hf(
    hf_dir,
    *,
    lr: float = 1e-3,
    use_distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    make_vocab_size_divisible_by: int | None = None,
    loss_scale: float | None = None,
    extra_args: dict | None = None,
):
    """mbridge's own model for an HF checkpoint, with the HF weights loaded, wrapped in megatron
    DDP, plus a megatron Adam optimizer. Returns (ddp_model, optimizer, gpt, bridge). Call after
    `init_distributed` (which also needs `import_mbridge()` before it: see there).

    CPU glue mbridge needs without Transformer Engine (field notes): the local decoder spec,
    no grouped GEMM / persistent norm / sequence parallel, `rope_theta` from transformers 5's
    `rope_parameters`, and `Module.cuda()` as a no-op."""
    from mbridge import AutoBridge
    from mbridge.core.safetensor_io import SafeTensorIO
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from transformers import AutoConfig

    from megatron_hook.families import TENamed

    cfg = AutoConfig.from_pretrained(hf_dir)
    if not hasattr(cfg, "rope_theta"):
        cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    bridge = AutoBridge.from_config(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    bridge.set_extra_args(
        moe_grouped_gemm=False,
        persist_layer_norm=False,
        sequence_parallel=False,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        moe_aux_loss_coeff=0.0,
        **(extra_args or {}),
    )
    cpu_specs(bridge)
    # DeepSeek-V3's fp8-dequantizing reader opens files on "cuda"; the tiny checkpoints are bf16.
    bridge._get_safetensor_io = lambda path: SafeTensorIO(bridge._get_actual_hf_path(path))
    torch.nn.Module.cuda = lambda self, *a, **k: self
    (f16,) = bridge.get_model(wrap_with_ddp=False, use_cpu_initialization=True)
    gpt = f16.module
    bridge.load_weights([TENamed(gpt)], hf_dir)  # mbridge sees the TE names its tables use
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_param_gather,
        overlap_param_gather=overlap_param_gather,
    )
    model = DistributedDataParallel(config=bridge.config, ddp_config=ddp_config, module=f16)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            bf16=True,
            lr=lr,
            weight_decay=0.0,
            clip_grad=1.0,
            use_distributed_optimizer=use_distributed_optimizer,
            loss_scale=loss_scale,
        ),
        [model],
    )
    return model, opt, gpt, bridge


class MLACoreAttention(torch.nn.Module):
    """Causal softmax attention for MLA's local spec (no parameters: the weights, names and shards
    stay megatron-core's `MLASelfAttention`). megatron-core 0.16's local `DotProductAttention`
    does not accept the `k_channels`/`v_channels` MLA passes (its query/key head dim differs from
    the value's), so without Transformer Engine MLA cannot be built at all."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        attention_dropout=None,
    ) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, h] -> [b, n, s, h]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def cpu_specs(bridge) -> None:
    """Point `bridge` at megatron-core's local (non-TE) specs: the decoder block, with
    `MLACoreAttention` in MLA layers, and (DeepSeek-V3) the MTP block, which mbridge asks of TE."""
    import mbridge.models.deepseek_v3 as ds
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    bridge._get_transformer_layer_spec = lambda vp_stage=None: _with_cpu_mla_attention(
        get_gpt_decoder_block_spec(
            bridge.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
    )
    ds.get_gpt_mtp_block_spec = lambda config, spec, use_transformer_engine, vp_stage=None: (
        get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
    )


def _with_cpu_mla_attention(block_spec):
    """The decoder block spec with `MLACoreAttention` in every MLA layer (others unchanged)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module is MLASelfAttention:
            attn.submodules.core_attention = MLACoreAttention
    return block_spec


def import_mbridge() -> None:
    """Import mbridge (and transformers' model code) before the shim: the shim's
    `torch.cuda.Stream` stand-in breaks an annotation transformers evaluates at import."""
    import mbridge  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    mbridge_mla_compat()


def mbridge_mla_compat() -> None:
    """mbridge 0.15.1's DeepSeek-V3 bridge passes `max_position_embeddings` to megatron-core 0.16's
    `MLATransformerConfig`, which renamed it `original_max_position_embeddings` (a TypeError in
    the bridge's constructor); pass it under the new name (idempotent)."""
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from megatron.core.transformer import MLATransformerConfig

    def config(**kw):
        if "max_position_embeddings" in kw:
            kw["original_max_position_embeddings"] = kw.pop("max_position_embeddings")
        return MLATransformerConfig(**kw)

    DeepseekV3Bridge.TransformerConfigClass = staticmethod(config)


def export_hf(bridge, gpt) -> dict[str, torch.Tensor]:
    """mbridge's own full HF export (every rank must call it; every rank gets every tensor)."""
    from megatron_hook.families import TENamed

    return {n: t.detach().clone() for n, t in bridge.export_weights([TENamed(gpt)])}


# --------------------------------------------------------------------------- tiny DeepSeek-V3


def tiny_deepseek_v3_config(layers: int = 2, mtp_layers: int = 0, dense_layers: int = 1):
    """DeepSeek-V3's structure at toy sizes: MLA (q and kv LoRA), `dense_layers` leading dense
    layers, then MoE (4 routed experts of 32, one shared, sigmoid router with a correction bias)."""
    from transformers import DeepseekV3Config

    from harness.tiny_models import VOCAB_SIZE

    cfg = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=dense_layers,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=512,
        num_nextn_predict_layers=mtp_layers,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if not hasattr(cfg, "rope_theta"):
        cfg.rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return cfg


def make_tiny_deepseek_v3(
    out_dir, layers: int = 2, mtp_layers: int = 0, dense_layers: int = 1, seed: int = 0
):
    """A tiny DeepSeek-V3 HF checkpoint (bf16, random): MLA with q and kv LoRA (and their norms),
    one leading dense layer, then MoE layers with 4 routed experts, one shared expert and the
    router's `e_score_correction_bias`; with `mtp_layers`, the MTP layers' tensors follow the
    decoder's as `model.layers.{layers + k}.*`, as in DeepSeek's checkpoint (transformers' model
    has no MTP module, so those are written from the decoder layer's shapes). An index file is
    written because mbridge's DeepSeek-V3 reader requires one."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from harness.tiny_models import train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_deepseek_v3_config(layers, mtp_layers, dense_layers)
    torch.manual_seed(seed)
    if mtp_layers:  # build the decoder with its MTP layers as ordinary layers, then rename the tail
        cfg.num_hidden_layers = layers + mtp_layers
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    cfg.num_hidden_layers = layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.01)
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.05)
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = tensors[name].float()  # fp32 in DeepSeek's checkpoint, as megatron's expert_bias
    gen = torch.Generator().manual_seed(seed + 1)
    for k in range(layers, layers + mtp_layers):
        pre = f"model.layers.{k}."
        h = cfg.hidden_size
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[pre + norm + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[pre + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.05).to(torch.bfloat16)
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    train_tokenizer(out)
    return out


_NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextmanager
def meta_chunk(
    cfg,
    *,
    world: int = 1,
    rank: int = 0,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    make_vocab_size_divisible_by: int | None = None,
    extra_args: dict | None = None,
) -> Iterator[tuple[torch.nn.Module, object]]:
    """(gpt, bridge): rank `rank`'s chunk of a `world`-rank job of HF config `cfg`, built by mbridge
    and megatron-core's local specs with every weight on `meta`, in this process (torch's `fake`
    process group: no collective runs). For reading megatron-core's own names, shapes and TP
    attributes at test time; everything patched is put back on exit."""
    import mbridge.models.deepseek_v3 as ds
    import megatron.core.transformer.multi_latent_attention as mla
    import torch.distributed as dist
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    mbridge_mla_compat()
    saved = (
        torch.cuda.current_device,
        torch.cuda.Stream,
        torch.nn.Module.cuda,
        torch.Tensor.cuda,
        mla.HAVE_TE,
        ds.get_gpt_mtp_block_spec,
    )
    torch.cuda.current_device = lambda: torch.device("meta")
    torch.cuda.Stream = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self  # an MTP stage's embedding copy (language_module.py)
    mla.HAVE_TE = False  # see install()
    env = {k: os.environ.get(k) for k in _NVTE}  # megatron sets these from the attention backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            create_gloo_process_groups=False,
        )
        bridge = AutoBridge.from_config(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
        bridge.set_extra_args(
            **{
                **dict(
                    moe_grouped_gemm=False,
                    persist_layer_norm=False,
                    sequence_parallel=False,
                    use_cpu_initialization=True,
                    gradient_accumulation_fusion=False,
                    masked_softmax_fusion=False,
                    bias_activation_fusion=False,
                    bias_dropout_fusion=False,
                ),
                **(extra_args or {}),
            }
        )
        cpu_specs(bridge)
        with torch.device("meta"):
            (f16,) = bridge.get_model(wrap_with_ddp=False, use_cpu_initialization=True)
        yield f16.module, bridge
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        (
            torch.cuda.current_device,
            torch.cuda.Stream,
            torch.nn.Module.cuda,
            torch.Tensor.cuda,
            mla.HAVE_TE,
            ds.get_gpt_mtp_block_spec,
        ) = saved
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
