"""Every StarTrail flag reaches the core attention, through the Megatron-LM patch's own lines and
through examples/pretrain_gpt.py's model_provider (both call ``startrail_spec_from_args``).

The patch's lines are run as they are in the patch file (tests/patch_text.py extracts them;
no Megatron-LM checkout needed): its extra_args_provider with megatron.training's
``parse_and_validate_args``, its ``validate_startrail_args`` call, its
``GPTModelConfig.transformer_layer_spec`` provider, and Megatron's ``GPTModelBuilder``, which
calls that provider the way ``pretrain`` does. 4 ranks, CP 4.
"""

from __future__ import annotations

import os
import sys

from tests.megatron.example import pretrain_gpt
from tests.megatron.utils import Utils, cpu_patches
from tests.multiproc import run_ranks
from tests.patch_text import added_block, added_lines

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.training import get_args  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.global_vars import unset_global_variables  # noqa: E402
from megatron.training.models.gpt import GPTModelBuilder, default_layer_spec  # noqa: E402

from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "1", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--context-parallel-size", "4", "--context-parallel-algo", "startrail",
]
# What run_on_cpu.py / check_on_cpu.sh give the patched script on a CPU.
CPU = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
       "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
       "--no-rope-fusion"]
# Each flag that changes the model, at a value other than its default (CP 4: teams of 2).
FLAGS = {
    "--startrail-team-size": "2",
    "--startrail-regather-in-backward": None,
    "--startrail-transfer": "multiring",
    "--startrail-backward-rotation": "kv",
    "--startrail-kernel": "reference",
}
DEFAULTS = ["--startrail-team-size", "1"]


def argv(flags):
    return [*MODEL, *CPU, *flags]


def flag_list(flags):
    return [x for name, value in flags.items() for x in (name, value) if x is not None]


def settings(model):
    """What each StarTrail core attention of ``model`` was built with."""
    cores = [m for m in model.modules() if isinstance(m, StarTrailCoreAttention)]
    assert len(cores) == 2  # one per layer
    configs = {c.startrail_groups.config for c in cores}
    return {(c.team_size, c.ulysses_size, c.transfer, c.regather_in_backward, c.backward_rotation, c.kernel)
            for c in configs}


def patched_script_model(flags):
    """The model the patched pretrain_gpt.py builds for ``flags``, through the patch's lines."""
    ns = {"has_nvidia_modelopt": False, "get_args": get_args, "default_layer_spec": default_layer_spec}
    exec("\n".join(line for line in added_lines() if line.startswith("from megatron_startrail")), ns)
    exec(added_block("def extra_args_provider(parser):"), ns)
    exec(added_block("def startrail_layer_spec(config, vp_stage=None):"), ns)
    # --mtp-num-layers: the patch's replacement of megatron.training's MTP block spec.
    exec("from megatron.training.models import gpt as gpt_models", ns)
    assert "from megatron.training.models import gpt as gpt_models" in added_lines()
    exec(added_block("def startrail_mtp_block_spec(config, transformer_layer_spec, vp_stage=None):"), ns)
    exec(added_block("megatron_mtp_block_spec = gpt_models.mtp_block_spec"), ns)
    sys.argv = ["pretrain_gpt.py", *argv(flags)]
    args = parse_and_validate_args(extra_args_provider=ns["extra_args_provider"],
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    ns["args"] = args
    exec("validate_startrail_args(args)", ns)
    assert "validate_startrail_args(args)" in [line.strip() for line in added_lines()]
    Utils.initialize_model_parallel(context_parallel_size=4)
    ns["model_cfg"] = gpt_config_from_args(args)
    exec(added_block('if args.context_parallel_algo != "megatron":'), ns)
    model_cfg = ns["model_cfg"]
    model_cfg.vocab_size = args.padded_vocab_size
    return GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())


def example_model(flags):
    """The model examples/pretrain_gpt.py builds for ``flags`` (its own parse and model_provider)."""
    sys.argv = ["pretrain_gpt.py", *argv(flags)]
    args = pretrain_gpt.parse_arguments()
    Utils.initialize_model_parallel(context_parallel_size=4)
    assert get_args() is args
    return pretrain_gpt.model_provider()


def worker(rank, world_size):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    cpu_patches.apply()
    out = {}
    for name, build, flags in [("patch", patched_script_model, flag_list(FLAGS)),
                               ("patch, defaults", patched_script_model, DEFAULTS),
                               ("example", example_model, flag_list(FLAGS)),
                               ("example, defaults", example_model, DEFAULTS)]:
        unset_global_variables()  # each program parses its flags into megatron.training's globals once
        out[name] = settings(build(flags))
    return out


def test_every_startrail_flag_reaches_the_core_attention_through_the_patch_and_the_example():
    results = run_ranks(worker, 4, timeout=240)
    wanted = {(2, 1, "multiring", True, "kv", "reference")}
    default = {(1, 1, "ring", False, "auto", "auto")}
    for got in results:
        assert got["patch"] == wanted and got["example"] == wanted, got
        # The same code with the flags left out builds something else: the flags are what set it.
        assert got["patch, defaults"] == default and got["example, defaults"] == default, got
