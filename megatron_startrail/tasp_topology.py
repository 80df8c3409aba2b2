"""TASP's topology decomposition: concurrent rings over a fully connected set of ranks.

A ring uses one outgoing link of every rank. On ``n`` fully connected ranks (a node
whose GPUs are all-to-all linked, a mesh of NICs) the complete directed graph K*_n
splits into ``n - 1`` arc-disjoint directed Hamiltonian cycles, except for n = 4 and
n = 6 (Tillson); sending 1/(n-1) of each transfer around each cycle keeps every link
busy at every step (TASP, Wang et al., arXiv 2509.26541).

Constructions
-------------
- odd n = 2m + 1: Walecki's decomposition of the undirected K_n into m Hamiltonian
  cycles (Lucas 1892; see B. Alspach, "The wonderful Walecki construction", Bull. ICA
  52 (2008)), each used in both directions. Vertex n-1 is the hub; cycle i is
  ``hub, i, i+1, i-1, i+2, i-2, ..., i+m (mod 2m)``. For n = 5::

      hub=4:  4 0 1 3 2     4 1 2 0 3      and their reverses: 4 arc-disjoint rings
- even n >= 8: a Hamiltonian decomposition exists (T. W. Tillson, "A Hamiltonian
  decomposition of K*_2m, 2m >= 8", J. Combin. Theory B 29 (1980) 68-74). Tillson's
  construction is intricate; here a seeded randomized depth-first search finds one
  (deterministic, verified by :func:`is_arc_disjoint_hamiltonian`; well under a
  second for n <= 16, cached).
- n = 4, 6 (no decomposition exists) and n <= 3: the largest set of arc-disjoint
  Hamiltonian cycles the same search finds (n = 4: 2 rings, n = 6: 4), so some links
  stay idle but every ring still visits every rank.

Routing: ring ``k`` carries part ``k`` of every rank's payload; at step ``s`` a rank
forwards what it received at step ``s - 1`` on that ring (its own part at step 0), so
after ``n - 1`` steps every rank has received every other rank's part ``k`` exactly
once (:func:`simulate_routing` checks it symbolically).
"""

from __future__ import annotations

import functools
import random

Cycle = tuple[int, ...]


def walecki_cycles(n: int) -> list[Cycle]:
    """``n - 1`` arc-disjoint directed Hamiltonian cycles for odd ``n >= 3``."""
    if n < 3 or n % 2 == 0:
        raise ValueError(f"Walecki's construction needs an odd n >= 3, got {n}")
    m, hub = (n - 1) // 2, n - 1
    undirected = []
    for i in range(m):
        order = [i]
        for j in range(1, m + 1):
            order.append((i + j) % (2 * m))
            if len(order) < 2 * m:
                order.append((i - j) % (2 * m))
        undirected.append((hub, *order[: 2 * m]))
    return [c for cyc in undirected for c in (cyc, (cyc[0],) + tuple(reversed(cyc[1:])))]


def _arcs(cycle: Cycle) -> list[tuple[int, int]]:
    return [(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle))]


def _find_cycle(n: int, out: list[set[int]], rng: random.Random, budget: int) -> Cycle | None:
    """A Hamiltonian cycle through the remaining arcs ``out`` (DFS, fewest options first)."""
    path, seen, calls = [0], [False] * n, [budget]
    seen[0] = True

    def dfs(u: int) -> bool:
        calls[0] -= 1
        if calls[0] < 0:
            return False
        if len(path) == n:
            return 0 in out[u]
        options = [v for v in out[u] if not seen[v]]
        rng.shuffle(options)
        options.sort(key=lambda v: sum(not seen[w] for w in out[v]))
        for v in options:
            seen[v] = True
            path.append(v)
            if dfs(v):
                return True
            seen[v] = False
            path.pop()
        return False

    return tuple(path) if dfs(0) else None


def _search(n: int, seed: int = 0, restarts: int = 400, budget: int = 20000) -> list[Cycle]:
    """Arc-disjoint Hamiltonian cycles, found greedily with seeded restarts; the largest set."""
    rng, best = random.Random(seed), []
    for _ in range(restarts):
        out = [set(range(n)) - {u} for u in range(n)]
        cycles = []
        while len(cycles) < n - 1:
            cycle = _find_cycle(n, out, rng, budget)
            if cycle is None:
                break
            for a, b in _arcs(cycle):
                out[a].discard(b)
            cycles.append(cycle)
        if len(cycles) > len(best):
            best = cycles
        if len(best) == n - 1:
            break
    return best


@functools.lru_cache(maxsize=64)
def multiring_cycles(n: int) -> tuple[Cycle, ...]:
    """The rings TASP uses on ``n`` fully connected ranks (vertex orders; see module doc)."""
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    if n <= 2:
        return (tuple(range(n)),)
    cycles = walecki_cycles(n) if n % 2 else _search(n)
    assert is_arc_disjoint_hamiltonian(n, cycles)
    return tuple(cycles)


def is_arc_disjoint_hamiltonian(n: int, cycles) -> bool:
    """Every cycle visits all ``n`` vertices once and no arc is used twice."""
    used = set()
    for cycle in cycles:
        if sorted(cycle) != list(range(n)):
            return False
        for arc in _arcs(tuple(cycle)):
            if arc in used:
                return False
            used.add(arc)
    return True


def is_hamiltonian_decomposition(n: int, cycles) -> bool:
    """Arc-disjoint Hamiltonian cycles covering every arc of K*_n exactly once."""
    return is_arc_disjoint_hamiltonian(n, cycles) and len(cycles) * n == n * (n - 1)


def simulate_routing(n: int, cycles) -> list[dict[tuple[int, int], int]]:
    """Run the relay schedule on symbols: per rank, how often it received (origin, part).

    Ring ``k`` carries part ``k``. At step ``s`` (0 .. n-2) every rank sends on every
    ring what it holds for that ring (its own part at step 0, then what it received) to
    its successor on the ring. Every rank must end with each (origin != itself, part)
    exactly once, and every step uses each ring's arcs once.
    """
    holding = [{k: (r, k) for k in range(len(cycles))} for r in range(n)]
    received: list[dict[tuple[int, int], int]] = [dict() for _ in range(n)]
    for _ in range(n - 1):
        incoming = [dict() for _ in range(n)]
        for k, cycle in enumerate(cycles):
            nxt = {a: b for a, b in _arcs(tuple(cycle))}
            for r in range(n):
                incoming[nxt[r]][k] = holding[r][k]
        for r in range(n):
            for k, item in incoming[r].items():
                received[r][item] = received[r].get(item, 0) + 1
            holding[r] = incoming[r]
    return received
