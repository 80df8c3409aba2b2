"""The DiT example's check (StarTrail without a mask inside a DiT block) on forked ranks."""

import pytest

from examples.dit_startrail import check
from tests.multiproc import run_ranks


@pytest.mark.parametrize("team_size,ulysses_size", [(2, 1), (2, 2)])
def test_dit_block_matches_no_context_parallelism(team_size, ulysses_size):
    for errors in run_ranks(check, 8, args=(team_size, ulysses_size)):
        assert max(errors.values()) <= 1e-10, errors
