"""One Megatron GPT training step at production shapes on fake CUDA (child side; needs the shim).

``python -m tests.fake_cuda.megatron_step --cp 8 --team 2 --json OUT`` (through
:func:`tests.fake_cuda.run.run_fake_cuda`) makes this process rank ``--rank`` of ``--cp`` GPUs
(TP1 PP1 DP1; :func:`tests.fake_cuda.rank.fake_cuda_rank`), builds a GPT with the StarTrail
layer spec from StarTrail's flags (``from_args.startrail_spec_from_args``, as
``examples/pretrain_gpt.py`` does) in bf16 on fake CUDA, wraps it as ``megatron.training``
does (Float16Module, Megatron's DDP) with the distributed optimizer, and runs one forward,
backward and optimizer step through Megatron's pipeline schedule on a random token batch,
this rank's share of the sequence. Nothing is computed: the step shows which code runs on a
GPU (kernel, transport), where the host waits for the device, and what the rank holds.

Written to ``--json``: the live bytes after each phase and the step's peak
(:class:`tests.fake_cuda.memory.LiveStorages`), the parameter count, the host syncs by
frame, the mixed-device ops, the kernel and transport used, and the step's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from megatron_startrail.megatron import cpu_patches

cpu_patches.install_import_shims()

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_startrail import kernels, transport  # noqa: E402
from megatron_startrail.accounting import AttentionShape  # noqa: E402
from megatron_startrail.groups import StarTrailGroups  # noqa: E402
from megatron_startrail.megatron.arguments import add_startrail_args  # noqa: E402
from megatron_startrail.megatron.from_args import startrail_spec_from_args  # noqa: E402
from megatron_startrail.planning.memory_model import activation_peak_bytes  # noqa: E402
from tests.fake_cuda.megatron_standins import megatron_on_fake_cuda, to_device_bf16  # noqa: E402
from tests.fake_cuda.memory import LiveStorages  # noqa: E402
from tests.fake_cuda.rank import fake_cuda_rank, is_package_frame  # noqa: E402
from tests.megatron.utils import cp_shard  # noqa: E402

GIB = 1 << 30


@contextlib.contextmanager
def used_kernels_and_transports():
    """Records the block kernel each attention call chose (``kernels.choose_kernel``, which
    ``kernel_for`` and ``check_kernel`` ask) and the transport class it communicated with
    (``StarTrailGroups.transports_on``); yields ``{"kernels": set, "transports": set}``."""
    used = {"kernels": set(), "transports": set(), "transport_classes": set()}
    choose, transports_on = kernels.choose_kernel, StarTrailGroups.transports_on

    def choose_spy(*args, **kwargs):
        choice = choose(*args, **kwargs)
        used["kernels"].add(choice.name)
        return choice

    def transports_spy(self, device):
        pair = transports_on(self, device)
        # the transport module's class: under pytest nccl_rules wraps it in a checking subclass
        used["transports"].update(next(c.__name__ for c in type(t).__mro__ if c.__module__ == transport.__name__)
                                  for t in pair)
        used["transport_classes"].update(type(t).__name__ for t in pair)
        return pair

    kernels.choose_kernel, StarTrailGroups.transports_on = choose_spy, transports_spy
    try:
        yield used
    finally:
        kernels.choose_kernel, StarTrailGroups.transports_on = choose, transports_on


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, nargs="+", default=[8], help="CP sizes, one run each (one process)")
    p.add_argument("--team", type=int, nargs="+", default=[2], help="a StarTrail team size per --cp")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=131072)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--query-groups", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def startrail_flags(opts) -> argparse.Namespace:
    """StarTrail's flags as ``examples/pretrain_gpt.py`` parses them (its own parser), plus the
    Megatron flags ``from_args`` reads. The team size is given, so nothing is left for
    ``validate_startrail_args`` to resolve (it needs all of Megatron's arguments)."""
    args = add_startrail_args(argparse.ArgumentParser()).parse_args(
        ["--context-parallel-algo", "startrail", "--startrail-team-size", str(opts.team)])
    args.context_parallel_size, args.distributed_timeout_minutes = opts.cp, 10
    return args


def gpt_config(opts) -> TransformerConfig:
    config = TransformerConfig(
        num_layers=opts.layers, hidden_size=opts.hidden, num_attention_heads=opts.heads,
        num_query_groups=opts.query_groups, kv_channels=opts.hidden // opts.heads, ffn_hidden_size=opts.ffn,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        context_parallel_size=opts.cp, calculate_per_token_loss=True,
    )
    cpu_patches.adapt_config(config)  # Megatron's fused kernels need apex / TE: off, as in every CPU run
    return config


def build(opts, config):
    """Model (Float16Module + DDP, params on ``cuda:0``) and Megatron's distributed optimizer."""
    spec = startrail_spec_from_args(get_gpt_layer_local_spec(normalization="RMSNorm"), startrail_flags(opts))
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=opts.vocab,
                   max_sequence_length=opts.seq_length, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    moved = to_device_bf16(gpt)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True, clip_grad=1.0),
        [model], use_gloo_process_groups=False)
    # What megatron.training's setup_model_and_optimizer hands the schedule.
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return gpt, model, optimizer, moved


def token_batch(opts):
    """Random tokens of the whole sequence, cut to this rank's share as Megatron's
    ``get_batch`` does (``get_batch_on_this_cp_rank``: chunks r and 2P-1-r)."""
    seq = opts.seq_length
    tokens = torch.randint(0, opts.vocab, (1, seq + 1), device="cuda")
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": torch.ones(1, seq, device="cuda"),
             "position_ids": torch.arange(seq, device="cuda").unsqueeze(0), "attention_mask": None}
    return cp_shard(batch, parallel_state.get_context_parallel_group())


def train_step(opts, model, optimizer, batch, memory: LiveStorages, marks: dict):
    """megatron.training's train_step for one micro-batch: zero the grad buffers, the schedule
    (forward, backward, finalize_model_grads: the grad reduce-scatter over DP x CP), the step.
    ``marks`` gets the live bytes and the peak so far at the end of the model's forward, of the
    schedule (backward and grad reduce-scatter) and of the optimizer step."""

    def mark(name):
        marks[name] = {"live": memory.live, "peak_so_far": memory.peak}

    model.zero_grad_buffer()
    optimizer.zero_grad()

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

        def loss_func(output_tensor):
            mark("forward_end")  # what the backward needs is held now, the per-token losses too
            marks["forward_end"]["by_op"] = memory.live_by_op()
            mask = b["loss_mask"].reshape(-1)
            loss = (output_tensor.float().reshape(-1) * mask).sum()
            return loss, mask.sum().to(torch.int), {"lm loss": loss.detach()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=opts.seq_length, micro_batch_size=1, forward_only=False)
    mark("backward_end")
    update_successful, grad_norm, _ = optimizer.step()
    mark("optimizer_end")
    return losses[0]["lm loss"], update_successful


def static_bytes(params: int, cp: int) -> dict[str, int]:
    """Closed form of what a rank holds between steps: bf16 parameters (2 bytes each), the fp32
    grad buffer (``grad_reduce_in_fp32``: 4), and the distributed optimizer's fp32 main
    parameters and two Adam moments (12) sharded over DP x CP = ``cp`` ranks (DP is 1)."""
    return {"params_bf16": 2 * params, "grads_fp32": 4 * params, "optimizer_fp32_shard": 12 * params // cp}


def attention_bytes(opts, cp: int, team: int) -> int:
    """The planner's peak of the StarTrail attention layers of one micro-batch on one rank."""
    shape = AttentionShape(seq_local=opts.seq_length // cp, batch=1, heads=opts.heads, kv_heads=opts.query_groups,
                           head_dim=opts.hidden // opts.heads, dtype_bytes=2)
    return activation_peak_bytes(shape, layers=opts.layers, cp_size=cp, team_size=team)


def run(opts, cp: int, team: int) -> dict:
    """One training step as rank ``opts.rank`` of a CP ``cp`` world with team size ``team``."""
    opts = argparse.Namespace(**{**vars(opts), "cp": cp, "team": team})
    config = gpt_config(opts)
    with fake_cuda_rank(opts.rank, cp, stand_in_values=True) as (_, rules), \
            LiveStorages(device_type="cuda") as memory, \
            used_kernels_and_transports() as used:
        facts = step_facts(opts, config, memory)
    return {
        **facts,
        "syncs": [list(s) for s in rules.syncs], "mixed": [list(m) for m in rules.mixed],
        "cuda_queries": [list(q) for q in rules.cuda_queries], "stand_ins": [list(v) for v in rules.stand_ins],
        "kernels": sorted(used["kernels"]), "transports": sorted(used["transports"]),
        "transport_classes": sorted(used["transport_classes"]),
        "attention_ops": sorted({str(f) for f in rules.ops if "attention" in str(f)}),
    }


def release(config) -> None:
    """Drops what ``build`` hung on ``config``: ``no_sync_func`` and ``grad_scale_func`` are bound
    methods of the DDP model and the optimizer, and the model's modules hold ``config``: a
    reference cycle that keeps the whole model (4.9 GiB at CP8 C2) until the garbage collector
    runs, into the next configuration's peak."""
    config.no_sync_func = config.grad_scale_func = config.finalize_model_grads_func = None


def step_facts(opts, config, memory, watch=None) -> dict:
    """Builds the model and runs one training step as rank ``opts.rank`` of ``opts.cp`` (the
    process group made by the caller: fake CUDA's here, a real device's in
    ``benchmarks/gpu/session_gpt.py``); ``memory`` has ``live``, ``peak``, ``reset_peak()`` and
    ``live_by_op()`` (:class:`tests.fake_cuda.memory.LiveStorages` or the CUDA allocator's), and
    may have ``synchronize()`` (a device: the step's time is read after its last kernel).
    ``watch(gpt)``, if given, sees the model once built (the GPU session keeps weak references)."""
    synchronize = getattr(memory, "synchronize", lambda: None)
    cp, team = opts.cp, opts.team
    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(1234)
        gpt, model, optimizer, moved = build(opts, config)
        if watch is not None:
            watch(gpt)
        params = sum(p.numel() for p in gpt.parameters())
        live = {"built": memory.live}  # model, grad buffers, optimizer's main params (moments: at the step)
        batch = token_batch(opts)
        live["with_batch"] = memory.live
        memory.reset_peak()
        synchronize()
        start = time.perf_counter()
        marks = {}
        loss, updated = train_step(opts, model, optimizer, batch, memory, marks)
        synchronize()  # the optimizer's kernels are queued, not done, when step() returns
        seconds = time.perf_counter() - start
        live["after_step"] = memory.live
        peak = memory.peak
        loss_facts = {"shape": list(loss.shape), "dtype": str(loss.dtype), "device": str(loss.device)}
        del gpt, model, optimizer, batch, loss
    finally:
        release(config)
        parallel_state.destroy_model_parallel()
    return {
        "cp": cp, "team": team, "rank": opts.rank, "seq_length": opts.seq_length,
        "shape": {k: getattr(opts, k) for k in ("layers", "hidden", "heads", "query_groups", "ffn", "vocab")},
        "params": params, "moved_to_cuda_bf16": moved, "live_bytes": live, "peak_bytes": peak, "step_marks": marks,
        "static_closed_form": static_bytes(params, cp),
        "attention_activation_peak_planner": attention_bytes(opts, cp, team),
        # Beyond what the rank holds between steps: activations, logits, the step's temporaries.
        "transient_bytes": peak - live["after_step"],
        "step_seconds": seconds, "loss": loss_facts, "update_successful": bool(updated),
    }


def main(argv=None) -> None:
    opts = parse(argv)
    if len(opts.cp) != len(opts.team):
        raise SystemExit("give one --team per --cp")
    megatron_on_fake_cuda()
    runs = []
    for cp, team in zip(opts.cp, opts.team):
        runs.append(run(opts, cp, team))
        r = runs[-1]
        print(f"CP{cp} C{team}: peak {r['peak_bytes'] / GIB:.2f} GiB per rank (between steps "
              f"{r['live_bytes']['after_step'] / GIB:.2f} GiB), step {r['step_seconds']:.1f} s, kernel "
              f"{r['kernels']}, transport {r['transports']}, syncs {len(r['syncs'])} "
              f"({sum(is_package_frame(f) for _, f in r['syncs'])} in megatron_startrail)", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"command": "python -m tests.fake_cuda.megatron_step " + " ".join(argv or sys.argv[1:]),
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
