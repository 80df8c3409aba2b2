"""Megatron's own communication in the NCCL replay (issue 38 item 4): in NCCL-rules mode
Megatron's DP x CP gradient reduce (bucketed, overlapped with --overlap-grad-reduce) is
recorded as one more communicator and replayed together with StarTrail's posts
(nccl_rules.record_megatron_grad_reduce)."""

import os
import re

import pytest

from megatron_startrail import nccl_rules
from tests.megatron.test_pretrain_example import COMMON
from tests.megatron.test_recompute import recompute_worker
from tests.multiproc import run_ranks


def test_megatrons_gradient_reduce_is_replayed_with_startrails_communication(tmp_path, monkeypatch):
    if not nccl_rules.enabled():
        pytest.skip("NCCL-rules mode is off (tests/conftest.py turns it on)")
    log = tmp_path / "replay.log"
    monkeypatch.setenv(nccl_rules.REPLAY_LOG, str(log))
    flags = ["--num-layers", "2", "--context-parallel-size", "2", "--context-parallel-algo", "startrail",
             "--startrail-team-size", "1", "--overlap-grad-reduce", "--train-iters", "2"]
    run_ranks(recompute_worker, 4, args=([*COMMON, *flags],), timeout=300)
    assert os.path.exists(log)
    posts = re.findall(r"'(\w+)': (\d+)", log.read_text())
    counts = {name: int(n) for name, n in posts}
    assert counts.get("megatron_dp_grads", 0) > 0 and counts.get("startrail", 0) > 0, log.read_text()
