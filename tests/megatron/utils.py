"""Upstream-style helpers for the Megatron tests (Megatron's tests/unit_tests ``Utils``).

Megatron is imported in the pytest process so that forked ranks inherit it. Everything
runs on CPU with gloo, through ``megatron_startrail.megatron.cpu_patches``.
"""

from __future__ import annotations

import inspect

from megatron_startrail.megatron import cpu_patches

cpu_patches.install_import_shims()

import torch  # noqa: E402

try:  # imported here so that forked ranks inherit it (megatron-core >= 0.17 ships it)
    import megatron.training  # noqa: F401
except ImportError:  # 0.16.x: megatron.core only
    pass
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 128, 64, 64, 8, 2


class Utils:
    """Initialize / destroy model-parallel state, like Megatron's ``tests/unit_tests`` ``Utils``.

    Here the world is the gloo one ``tests.multiproc.run_ranks`` already initialized, and
    megatron-core runs on the CPU through ``cpu_patches``.
    """

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1, seed=123, **kwargs
    ):
        cpu_patches.apply()
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            **kwargs,
        )
        model_parallel_cuda_manual_seed(seed)

    @staticmethod
    def destroy_model_parallel():
        parallel_state.destroy_model_parallel()
        dist.barrier()


def tiny_gpt(tp=1, pp=1, cp=1, team_size=1, ulysses_size=1, query_groups=None, seed=1234, window=None, *,
             position_embedding_type="rope", no_rope_freq=None, groups=None):
    """A 2-layer GPT on this rank's pipeline stage; StarTrail core attention when cp > 1.
    ``window``: ``(window_size, window_attn_skip_freq)`` (Megatron's --window-size and
    --window-attn-skip-freq). ``position_embedding_type`` and ``no_rope_freq`` are Megatron's
    --position-embedding-type and --no-rope-freq. ``groups``: StarTrail groups already built
    (e.g. with a ``backward_rotation``), so that one world can build many models without
    making new groups for each; by default they are made from ``team_size``, ``ulysses_size``."""
    torch.manual_seed(seed)
    window_size, skip_freq = window if window is not None else (None, None)
    config = TransformerConfig(
        window_size=window_size, window_attn_skip_freq=skip_freq, no_rope_freq=no_rope_freq,
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=query_groups,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        batch_p2p_sync=False, pipeline_dtype=torch.float32,
        calculate_per_token_loss=True,  # the schedule then leaves our summed loss unscaled
    )
    spec = get_gpt_layer_local_spec()
    if cp > 1:
        spec = to_startrail_spec(spec, groups if groups is not None else initialize_startrail(team_size, ulysses_size))
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type=position_embedding_type,
    )


def sample_batch(sample: int, batch: int = 1):
    """Random tokens (seeded by ``sample``) with next-token labels, full sequence."""
    gen = torch.Generator().manual_seed(1000 + sample)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": (torch.rand(batch, SEQ, generator=gen) > 0.1).float(),
        "position_ids": torch.arange(SEQ).expand(batch, SEQ).contiguous(),
        "attention_mask": None,
    }


def cp_shard(batch, cp_group):
    """``get_batch_on_this_cp_rank``: 0.19 added an ``is_hybrid_cp`` argument before ``cp_group``."""
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, False, cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)  # megatron-core 0.16.x


def forward_backward(model, batch):
    """One pipeline schedule over one microbatch; returns the summed masked loss (last stage).

    The loss is the *sum* over this CP rank's tokens, so summing over CP ranks gives the
    full-sequence loss; gradients likewise sum over the CP (and DP) group.
    """
    seq_length, micro_batch = batch["tokens"].shape[1], batch["tokens"].shape[0]  # before the CP split
    batch = cp_shard(dict(batch), parallel_state.get_context_parallel_group())

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

        def loss_func(output_tensor):
            loss = (output_tensor.float() * b["loss_mask"]).sum()
            tokens = b["loss_mask"].sum().to(torch.int)
            return loss, tokens, {"loss_sum": loss.detach().clone()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=micro_batch, forward_only=False,
    )
    return sum(float(x["loss_sum"]) for x in losses) if losses else None


def sgd_step_on_summed_grads(model, group, lr: float) -> dict:
    """Sum every parameter's gradient over ``group`` (what Megatron's DDP does over DP x CP),
    take a plain SGD step with it, and return the summed gradients by name."""
    params = list(model.named_parameters())
    flat = torch.cat([p.grad.detach().reshape(-1) for _, p in params])
    dist.all_reduce(flat, group=group)  # one call, not one per parameter: 16 gloo ranks share 2 cores
    grads = {}
    for (name, p), g in zip(params, flat.split([p.numel() for _, p in params])):
        grads[name] = g.view_as(p).clone()
        p.data.add_(grads[name], alpha=-lr)
    return grads


def train_steps(model, steps: int, lr: float, batch_of_step) -> tuple[list[float], dict]:
    """``steps`` steps of SGD on the gradients summed over DP x CP; returns the loss of every
    step summed over DP x CP (0 off the last pipeline stage) and the first step's summed
    gradients by name. ``batch_of_step(step)``: this rank's (pre-CP-split) batch.

    The first step's gradients are what a CP bug shows first and best: a loss after a
    step moves by lr x the gradient error only, below any loss tolerance (issue 36)."""
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    losses, first_grads = [], None
    for step in range(steps):
        model.zero_grad(set_to_none=False)
        loss = forward_backward(model, batch_of_step(step))
        total = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(total, group=dp_cp_group)
        grads = sgd_step_on_summed_grads(model, dp_cp_group, lr)
        losses.append(total.item())
        first_grads = grads if first_grads is None else first_grads
    return losses, first_grads


def relative_grad_errors(grads: dict, ref: dict) -> dict:
    """Per parameter: max|g - g_ref| / max|g_ref| (1e-30 guards a zero reference gradient).

    Per parameter, not one norm over the model: a wrong gradient in one small tensor (a
    layer norm, one layer's QKV) would vanish in a global norm dominated by the embedding."""
    assert set(grads) == set(ref), f"different parameters: {sorted(set(grads) ^ set(ref))}"
    return {name: ((grads[name] - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-30)).item()
            for name in ref}


def worst_grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    """The largest per-parameter relative gradient error and its parameter's name."""
    errors = relative_grad_errors(grads, ref)
    name = max(errors, key=errors.get)
    return errors[name], name


def record_first_step_grads(step: int = 1, every_chunk: bool = False) -> dict:
    """In a forked rank about to run megatron.training's pretrain (examples/pretrain_gpt.py):
    after the first ``finalize_model_grads`` (gradients reduced over DP x CP, the expert ones
    over expert DP, and scaled as Megatron's DDP does), keep every parameter's ``main_grad``,
    by name. Returns the dict that then holds them under "grads" (empty before the first step).
    ``step``: keep the grads of this run's ``step``-th step instead (1: its first).
    ``every_chunk``: those of every model chunk (virtual pipeline stages), by ``chunk{i}.name``,
    not only the first's. Patched in this forked rank only; the run itself is unchanged."""
    from megatron.training import training  # noqa: PLC0415

    recorded: dict = {}
    calls = [0]
    finalize = training.finalize_model_grads

    def recording(model, *args, **kwargs):
        out = finalize(model, *args, **kwargs)
        calls[0] += 1
        if calls[0] == step:
            chunks = enumerate(model if every_chunk else model[:1])
            recorded["grads"] = {(f"chunk{i}.{name}" if every_chunk else name): grad
                                 for i, chunk in chunks for name, grad in unsharded_grads(chunk).items()}
        return out

    training.finalize_model_grads = recording
    return recorded


def unsharded_grads(chunk) -> dict:
    """Every parameter's reduced gradient, whole, in float64, by name. Megatron's DDP keeps it in
    ``main_grad``; with ``--use-torch-fsdp2`` each rank holds a dim-0 shard in ``grad`` (a
    DTensor); with ``--use-megatron-fsdp`` (sharding ``optim_grads`` / ``optim_grads_params``)
    a piece of its flat gradient buffer (an uneven DTensor per parameter, empty on some ranks,
    where ``grad`` is None). The sharded ones are gathered: collective, so every rank of the
    data-parallel group calls this, for the same parameters in the same order."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor  # noqa: PLC0415
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import find_megatron_fsdp  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    fsdp = find_megatron_fsdp(chunk)
    if fsdp is not None:  # by the buffer's names (the module's, without the wrappers' "module." prefixes)
        grads = fsdp.param_and_grad_buffer.dist_main_grad
        return {name: _gather_uneven(grads[name], uneven_dtensor) for name in sorted(grads)}
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.main_grad).detach().clone().double()
            for name, p in chunk.named_parameters()}


def _gather_uneven(dtensor, uneven_dtensor) -> torch.Tensor:
    """A Megatron-FSDP gradient, whole, in float64. Megatron's own ``uneven_dtensor_to_full_tensor``
    all-gathers pieces of unequal sizes, which gloo refuses ("ProcessGroupGloo::allgather:
    invalid tensor size"): here each rank writes its piece (its chunk's offsets and sizes) into
    zeros and the group sums them, each element owned by exactly one rank (asserted)."""
    local = dtensor._local_tensor
    if not hasattr(local, "__create_chunk_list__"):
        uneven_dtensor.update_uneven_dtensor_chunk_metadata(dtensor)  # collective
    (piece,) = local.__create_chunk_list__()
    where = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))
    full = torch.zeros(dtensor.shape, dtype=torch.float64)
    owners = torch.zeros(dtensor.shape, dtype=torch.int32)
    full[where] = local.detach().double().reshape(piece.sizes)
    owners[where] = 1
    group = dtensor.device_mesh.get_group()  # a 1-D mesh: DP x CP (no TP here)
    dist.all_reduce(full, group=group)
    dist.all_reduce(owners, group=group)
    assert bool((owners == 1).all()), "a Megatron-FSDP gradient's pieces do not tile it"
    return full


def assert_first_step_grads_match(grads: dict, ref: dict, what: str, tol: float = 1e-5) -> float:
    """``worst_grad_error`` <= ``tol``; prints the figure (shown with pytest -s) and returns it."""
    err, name = worst_grad_error(grads, ref)
    print(f"{what}: worst relative first-step grad error {err:.2e} ({name})")
    assert err <= tol, f"{what} {name}: relative grad error {err:.2e} > {tol:.0e}"
    return err


def results_of_tp_rank(results):
    """End of a forked world that ran several models: ``(TP rank, results)`` on DP x CP rank 0
    (its results stand for its TP rank), None elsewhere; model parallelism torn down."""
    keep = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    Utils.destroy_model_parallel()
    return (tp_rank, results) if keep else None


def by_tp_rank(results):
    """The worlds' :func:`results_of_tp_rank` by TP rank."""
    return dict(r for r in results if r is not None)
