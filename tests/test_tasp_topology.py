"""TASP's ring decomposition and relay routing, pure."""

import time

import pytest

from megatron_startrail.tasp_topology import (
    is_arc_disjoint_hamiltonian,
    is_hamiltonian_decomposition,
    multiring_cycles,
    simulate_routing,
    walecki_cycles,
)


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8, 9, 10, 11, 12, 13, 16])
def test_full_decomposition_where_one_exists(n):
    cycles = multiring_cycles(n)
    assert len(cycles) == n - 1
    assert is_hamiltonian_decomposition(n, cycles)


@pytest.mark.parametrize("n,rings", [(4, 2), (6, 4)])
def test_fallback_uses_as_many_disjoint_rings_as_exist(n, rings):
    # K*_4 and K*_6 have no Hamiltonian decomposition (Tillson); n-2 rings do exist.
    cycles = multiring_cycles(n)
    assert len(cycles) == rings and is_arc_disjoint_hamiltonian(n, cycles)
    assert not is_hamiltonian_decomposition(n, cycles)


def test_walecki_small_case_and_checker_rejects_bad_sets():
    assert walecki_cycles(5) == [(4, 0, 1, 3, 2), (4, 2, 3, 1, 0), (4, 1, 2, 0, 3), (4, 3, 0, 2, 1)]
    assert not is_arc_disjoint_hamiltonian(3, [(0, 1, 2), (0, 1, 2)])  # shared arcs
    assert not is_arc_disjoint_hamiltonian(3, [(0, 1, 1)])  # not a permutation
    with pytest.raises(ValueError):
        walecki_cycles(6)


@pytest.mark.parametrize("n", range(2, 17))
def test_relay_routing_delivers_every_part_exactly_once(n):
    cycles = multiring_cycles(n)
    received = simulate_routing(n, cycles)
    for r in range(n):
        want = {(o, k): 1 for o in range(n) if o != r for k in range(len(cycles))}
        assert received[r] == want


def test_search_is_fast_and_deterministic():
    multiring_cycles.cache_clear()
    start = time.perf_counter()
    first = [multiring_cycles(n) for n in (8, 10, 12, 14, 16)]
    assert time.perf_counter() - start < 5.0
    multiring_cycles.cache_clear()
    assert first == [multiring_cycles(n) for n in (8, 10, 12, 14, 16)]
