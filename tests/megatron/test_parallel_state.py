"""StarTrail groups from Megatron's grid: the pure CP-group math, then the real groups."""

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from tests.megatron.utils import Utils, parallel_state
from tests.multiproc import MEGATRON_TIMEOUT_MINUTES, PG_TIMEOUT_S, run_ranks

from megatron_startrail.megatron.parallel_state import context_parallel_groups, initialize_startrail


def coordinates(rank, tp, cp, dp, pp):
    """(tp, cp, dp, pp) coordinates of a rank in Megatron's default order tp-cp-ep-dp-pp."""
    rank, t = divmod(rank, tp)
    rank, c = divmod(rank, cp)
    p, d = divmod(rank, dp)
    return t, c, d, p


def test_cp_groups_of_known_grids():
    # docs/design.md, "Where it sits in Megatron": world 8, TP=2, CP=4 -> [0,2,4,6] and [1,3,5,7]
    assert context_parallel_groups(8, tp=2, cp=4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert context_parallel_groups(8, cp=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert context_parallel_groups(8, tp=2, pp=2, cp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert context_parallel_groups(8, cp=2, order="tp-cp-ep-pp-dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        context_parallel_groups(12, tp=2, cp=4)


@pytest.mark.parametrize("tp, cp, dp, pp", [(8, 16, 4, 2), (1, 64, 8, 4), (4, 3, 5, 2), (2, 128, 1, 8)])
def test_cp_groups_share_every_other_coordinate_at_scale(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    groups = context_parallel_groups(world, tp=tp, pp=pp, cp=cp)
    assert sorted(itertools.chain(*groups)) == list(range(world))
    assert len(groups) == tp * dp * pp and all(len(g) == cp for g in groups)
    for group in groups:
        coords = [coordinates(r, tp, cp, dp, pp) for r in group]
        assert [c[1] for c in coords] == list(range(cp))  # listed in CP-rank order
        assert len({(t, d, p) for t, _, d, p in coords}) == 1


def check_worker(rank, world_size, tp, pp, cp, team_size, ulysses):
    Utils.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                    context_parallel_size=cp)
    groups = initialize_startrail(team_size, ulysses)
    megatron_cp = list(parallel_state.get_context_parallel_global_ranks())
    result = (
        megatron_cp, list(groups.cp_global_ranks), groups.cp_rank, parallel_state.get_context_parallel_rank(),
        list(groups.startrail_global_ranks), groups.team_size,
    )
    Utils.destroy_model_parallel()
    return result


@pytest.mark.parametrize("tp, pp, cp, team_size, ulysses", [(2, 1, 4, 2, 1), (2, 2, 2, 1, 1), (1, 2, 4, 1, 2)])
def test_startrail_groups_sit_inside_megatrons_cp_groups(tp, pp, cp, team_size, ulysses):
    results = run_ranks(check_worker, 8, args=(tp, pp, cp, team_size, ulysses), timeout=120)
    expected = context_parallel_groups(8, tp=tp, pp=pp, cp=cp)
    for rank, (megatron_cp, cp_ranks, cp_rank, megatron_cp_rank, st_ranks, c) in enumerate(results):
        assert megatron_cp in expected and rank in megatron_cp
        assert cp_ranks == megatron_cp and cp_rank == megatron_cp_rank
        # the StarTrail group: stride U inside the CP group, through this rank
        assert rank in st_ranks and st_ranks == megatron_cp[cp_rank % ulysses :: ulysses]
        assert c == team_size


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def timeouts_worker(rank, world_size):
    Utils.initialize_model_parallel(context_parallel_size=2, pipeline_model_parallel_size=2)
    groups = initialize_startrail(1, 1)
    result = {
        "pp": _timeout_s(parallel_state.get_pipeline_model_parallel_group()),
        "cp": _timeout_s(parallel_state.get_context_parallel_group()),
        "dp gloo": _timeout_s(parallel_state.get_data_parallel_group_gloo()),
        "startrail": _timeout_s(groups.startrail_group),
    }
    Utils.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2, distributed_timeout_minutes=7)
    result["cp, 7 minutes asked"] = _timeout_s(parallel_state.get_context_parallel_group())
    Utils.destroy_model_parallel()
    return result


def test_megatrons_groups_in_a_test_world_time_out_like_the_world():
    # Megatron gives its groups 30 minutes unless told otherwise: a hung Megatron collective in a
    # test would wait that long (tests/multiproc.py: _megatron_groups_take_the_test_timeout).
    minutes = MEGATRON_TIMEOUT_MINUTES
    assert minutes < 30, "a test timeout of Megatron's own default proves nothing here"
    for result in run_ranks(timeouts_worker, 4, timeout=120):
        assert result == {"pp": 60.0 * minutes, "cp": 60.0 * minutes, "dp gloo": 60.0 * minutes,
                          "startrail": PG_TIMEOUT_S, "cp, 7 minutes asked": 420.0}, result


def _gloo_loop_threads() -> int:
    """Threads of this process that gloo's TCP devices poll their sockets in (one per device)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("gloo_tcp_loop")


def shared_device_worker(rank, world_size):
    Utils.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    groups = initialize_startrail(1, 1)
    world_backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    # What runs on the groups: a TP all-reduce, a batched P2P on the CP ring, StarTrail's group.
    tp = parallel_state.get_tensor_model_parallel_group()
    summed = torch.full((3,), float(rank))
    dist.all_reduce(summed, group=tp)
    cp_ranks = parallel_state.get_context_parallel_global_ranks()
    peer = cp_ranks[1 - parallel_state.get_context_parallel_rank()]
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer, group=parallel_state.get_context_parallel_group()),
           dist.P2POp(dist.irecv, got, peer, group=parallel_state.get_context_parallel_group())]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    member = torch.ones(1)
    dist.all_reduce(member, group=groups.startrail_group)
    result = {"loop threads": _gloo_loop_threads(), "groups": len(dist.distributed_c10d._world.pg_map),
              "gloo backend": isinstance(world_backend, dist.ProcessGroupGloo),
              "tp sum": summed.tolist(), "cp peer": (peer, got.tolist()), "startrail size": member.item()}
    Utils.destroy_model_parallel()
    return result


def test_a_test_worlds_gloo_groups_share_one_device_per_rank():
    # tests/multiproc.py: _gloo_groups_share_one_device. Torch makes one gloo device, and with it
    # one polling thread, per group: ~30 in a Megatron world. The groups must still work.
    for rank, result in enumerate(run_ranks(shared_device_worker, 4, timeout=120)):
        tp_peer = rank ^ 1
        assert result["groups"] > 10, result  # Megatron made its many groups...
        assert result["loop threads"] == 1, result  # ...and they poll in one thread
        assert result["gloo backend"] and result["startrail size"] == 2.0, result
        assert result["tp sum"] == [float(rank + tp_peer)] * 3, result
        cp_peer = rank ^ 2  # TP 2 x CP 2: CP groups [0, 2] and [1, 3]
        assert result["cp peer"] == (cp_peer, [float(cp_peer)] * 2), result
