"""Every rank's program at scale, replayed under NCCL's rules (benchmarks/counters/scale_replay.py),
reduced: P = 32 and 64, a few configurations, dynamic CP at DP x CP = 64 -- each replays
with no hang and no mismatch -- and the planted bug (one rank skipping one piece of its
initial send), planted in the P = 64 C = 8 recording, is named: the rank, and the initial send.
(The benchmark plants it at P = 128, C = 8; here the same team size on the recording the test
above made already: recording P = 128 again was 24-27 s of one core in a full run.)"""

import pytest

from benchmarks.counters.scale_replay import (
    Config,
    planted_bug,
    problems_of,
    record_dynamic,
    record_static,
    simulate_global_batch,
)

REDUCED = [Config(32, 2), Config(32, 2, ulysses=2), Config(32, 4, rotation="q", regather=True),
           Config(32, 4, window="halo"), Config(32, 2, docs="document", local_tokens=32), Config(64, 8),
           Config(64, 4, ulysses=4, window="schedule")]


PLANTED = Config(64, 8)  # the recording the planted bug goes into


@pytest.fixture(scope="module")
def planted_recording():
    """PLANTED's recording, made once for the module (its replay test and the planted bug's)."""
    return record_static(PLANTED)


@pytest.mark.parametrize("cfg", REDUCED, ids=lambda c: c.name)
def test_every_ranks_program_replays_without_hang_or_mismatch(cfg, request):
    recording = request.getfixturevalue("planted_recording") if cfg == PLANTED else record_static(cfg)
    assert len(recording.programs) == cfg.world
    assert problems_of(recording) == []
    # Megatron's CP group is StarTrail's (Note [communicators]): its twin and, for C > 1, the
    # team; with Ulysses its group and the StarTrail group and twin as well.
    expected = 1 + (cfg.team > 1) + 3 * (cfg.ulysses > 1)
    assert set(recording.comms.values()) == {expected}


def test_dynamic_cp_at_64_replays_and_reuses_megatrons_groups_for_its_teams():
    """Hybrid CP at DP x CP = 64 (C <= 8): one global batch, every rank's sub-samples on the
    groups of their CP size; the teams are Megatron's aligned groups of 2, 4 and 8, so each
    rank holds a twin per CP size 2..64 and nothing more (6 communicators; 11 before)."""
    schedule = simulate_global_batch(64, seed=1)
    recording = record_dynamic(64, 8, schedule)
    assert problems_of(recording) == []
    assert set(recording.comms.values()) == {6}


def test_the_planted_bug_is_named_rank_and_initial_send(planted_recording):
    peer, problems = planted_bug(PLANTED.world, PLANTED.team, 5, recording=planted_recording)
    assert problems_of(planted_recording) == []  # the clean recording is left as it was
    named = [p for p in problems if "from rank 5" in p and "init_send" in p and "has no send" in p]
    assert named, problems[:3]
    assert named[0].startswith(f"rank {peer}'s receive")
