"""Run a Megatron-LM checkout's patched pretrain_gpt.py on CPU (how the patch was checked).

    MEGATRON_LM=/path/to/Megatron-LM torchrun --nproc-per-node 8 patches/run_on_cpu.py <pretrain_gpt.py flags>

Applies megatron_startrail's CPU patches (no GPU needed), then runs the checkout's own
pretrain_gpt.py unchanged apart from the patch. GPU clusters do not need this file.
"""

import os
import runpy
import sys

import torch

from megatron_startrail.megatron import cpu_patches

MEGATRON_LM = os.environ["MEGATRON_LM"]
sys.path.insert(0, MEGATRON_LM)  # the checkout's megatron/, gpt_builders.py, model_provider.py
cpu_patches.install_import_shims()
cpu_patches.apply()
# megatron.training initializes model parallelism only when it sees a device.
torch.cuda.device_count = lambda: 1
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
runpy.run_path(os.path.join(MEGATRON_LM, "pretrain_gpt.py"), run_name="__main__")
