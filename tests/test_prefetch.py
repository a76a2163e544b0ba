"""Libra's Hierarchical Expert Prefetcher (Libra Appendix B, Alg. 1; :mod:`moebalance.algorithms.prefetch`).

The contract these tests pin is the module docstring's reading of Alg. 1:

- phase 1: each GPU takes its ``L = floor(n * alpha)`` most requested experts it does not hold, only experts
  its own tokens request (ties to the lower id);
- load model: a pick whose expert has a copy on the token's GPU is local; expert ``e``'s remote picks ``R_e``
  start evenly split over its copies; ``B = total / G``;
- phase 2: most loaded GPU ``src`` (stop at ``<= B``), its expert with the most remote load, the least loaded
  GPU without it and with room; localise that GPU's own picks (taken from the copies in proportion), then move
  ``min(S[src, e], load[src] - B, B - load[dst])``; a duplication is made only if ``load[dst] + own <= B``, and
  the loop stops at the first pass that finds nothing to do.

The hand-checked case is our reconstruction of the paper's Figure 6. The property tests compare with
:func:`_reference`, a slow reading of the docstring in exact rational arithmetic (so exact ties really go to
the lower id), and check facts that hold whatever the order of moves.
"""

from __future__ import annotations

from fractions import Fraction

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from moebalance.algorithms.prefetch import phase1_count, prefetch, prefetch_layers
from moebalance.core.errors import InputError

# ----------------------------------------------------------------------------------------------------------
# helpers written from the spec (not from the implementation)
# ----------------------------------------------------------------------------------------------------------


def _rows(extras: np.ndarray) -> list[list[int]]:
    """``extras [G, N]`` (-1 padded) as per-GPU lists; checks that the padding is a suffix."""
    out = []
    for row in extras:
        ids = [int(e) for e in row]
        k = sum(e >= 0 for e in ids)
        assert all(e >= 0 for e in ids[:k]) and all(e == -1 for e in ids[k:]), f"bad padding in {ids}"
        out.append(ids[:k])
    return out


def _reference(demand: np.ndarray, hosted: np.ndarray, n: int, alpha: float
               ) -> tuple[list[list[int]], list[Fraction], list[int]]:
    """``(extras per GPU, expected loads, phase-1 extras per GPU)``: the docstring's Alg. 1, step by step, in
    exact arithmetic (every quantity a Fraction, ties by the lower id)."""
    G, E = demand.shape
    d = [[Fraction(int(demand[g, e])) for e in range(E)] for g in range(G)]
    L = int(np.floor(n * alpha + 1e-12))
    has = [[bool(hosted[g, e]) for e in range(E)] for g in range(G)]
    extras: list[list[int]] = [[] for _ in range(G)]
    for g in range(G):
        wanted = sorted((e for e in range(E) if not has[g][e] and d[g][e] > 0), key=lambda e: (-d[g][e], e))
        for e in wanted[:L]:
            has[g][e] = True
            extras[g].append(e)
    phase1 = [len(x) for x in extras]
    zero = Fraction(0)
    share = [[zero] * E for _ in range(G)]
    load = [zero] * G
    for e in range(E):
        holders = [g for g in range(G) if has[g][e]]
        remote = sum((d[g][e] for g in range(G) if not has[g][e]), zero)
        for g in holders:
            share[g][e] = remote / len(holders)
            load[g] += d[g][e] + share[g][e]
    B = sum((sum(row, zero) for row in d), zero) / G
    for _ in range((n - L) * G):
        src = min(range(G), key=lambda g: (-load[g], g))
        if load[src] <= B:
            break
        e = min(range(E), key=lambda x: (-share[src][x], x))
        if share[src][e] <= 0:
            break
        room = [g for g in range(G) if not has[g][e] and len(extras[g]) < n]
        if not room:
            break
        dst = min(room, key=lambda g: (load[g], g))
        own = d[dst][e]
        if load[dst] + own > B:
            break
        remote = sum((share[g][e] for g in range(G)), zero)
        if own > 0 and remote > 0:
            for g in range(G):
                cut = share[g][e] * min(own, remote) / remote
                share[g][e] -= cut
                load[g] -= cut
        has[dst][e] = True
        extras[dst].append(e)
        load[dst] += own
        x = min(share[src][e], load[src] - B, B - load[dst])
        if x > 0:
            share[src][e] -= x
            load[src] -= x
            share[dst][e] += x
            load[dst] += x
    return extras, load, phase1


def _split_load(demand: np.ndarray, has: np.ndarray) -> np.ndarray:
    """The load model without phase-2 moves: local picks stay, remote picks split evenly over the copies."""
    demand = demand.astype(float)
    copies = has.sum(axis=0)  # [E]
    remote = (demand * ~has).sum(axis=0)  # [E]
    return (demand * has).sum(axis=1) + (has * (remote / copies)[None, :]).sum(axis=1)


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Small ``(demand [G, E] ints, hosted [G, E], n, alpha)`` with every expert on >= 1 GPU."""
    G, E = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    hosted = np.zeros((G, E), dtype=bool)
    for e in range(E):
        hosted[rng.choice(G, size=int(rng.integers(1, G + 1)), replace=False), e] = True
    hi = draw(st.integers(1, 12))
    demand = rng.integers(0, hi, size=(G, E)) * (rng.random((G, E)) < draw(st.sampled_from([0.3, 0.7, 1.0])))
    return demand.astype(np.int64), hosted, draw(st.integers(0, min(4, E))), draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))


# ----------------------------------------------------------------------------------------------------------
# hand-checked cases
# ----------------------------------------------------------------------------------------------------------

HOMES = np.zeros((3, 6), dtype=bool)
HOMES[0, [0, 1]] = HOMES[1, [2, 3]] = HOMES[2, [4, 5]] = True
FIG6 = np.array([[2, 1, 3, 0, 4, 0],   # tokens of GPU 0 requesting E0..E5
                 [1, 0, 4, 2, 0, 0],   # GPU 1
                 [0, 3, 2, 0, 1, 1]])  # GPU 2


def test_figure6_golden() -> None:
    # Our reconstruction of Figure 6: GPU 0 copies E4 from GPU 2 (locality), then the hot E2 is duplicated onto
    # an under-loaded GPU. n = 2, alpha = 0.5: L = 1 locality slot, 1 balancing slot per GPU.
    #
    # Phase 1 (each GPU's most requested expert it does not hold):
    #   GPU 0 holds E0, E1; wants E4 (4) > E2 (3)      -> takes E4
    #   GPU 1 holds E2, E3; only remote request is E0  -> takes E0
    #   GPU 2 holds E4, E5; wants E1 (3) > E2 (2)      -> takes E1
    # Local loads: GPU 0: E0 2 + E1 1 + E4 4 = 7; GPU 1: E0 1 + E2 4 + E3 2 = 7; GPU 2: E1 3 + E4 1 + E5 1 = 5.
    # Remote picks: E2 from GPU 0 (3) and GPU 2 (2) = 5, all to GPU 1 (its only holder); every other pick is local.
    # Loads 7, 12, 5; B = 24 / 3 = 8.
    # Phase 2, pass 1: src = GPU 1 (12 > 8), e = E2 (remote share 5), dst = least loaded GPU without E2 and with
    #   < 2 extras = GPU 2 (5); own = demand[2, E2] = 2, 5 + 2 <= 8: duplicate. Localising takes GPU 2's 2 picks
    #   out of E2's remote 5 (GPU 1's share 5 -> 3, load 12 -> 10), GPU 2 -> 5 + 2 = 7; then the transfer
    #   min(3, 10 - 8, 8 - 7) = 1: loads 7, 9, 8.
    # Pass 2: src = GPU 1 (9 > 8), e = E2 (share 2), dst = GPU 0 (7, the only GPU without E2, 1 extra so far);
    #   own = 3, 7 + 3 > 8: stop.
    extras, load = prefetch(FIG6, HOMES, 2, 0.5)
    assert extras.tolist() == [[4, -1], [0, -1], [1, 2]]
    assert load.tolist() == pytest.approx([7.0, 9.0, 8.0])
    assert extras.dtype == np.int64 and extras.shape == (3, 2)


def test_figure6_phase1_only_and_phase2_only() -> None:
    # alpha = 1 (n = 2, L = 2): phase 1 only. GPU 0 takes E4 (4), E2 (3); GPU 1 takes E0 (1) only (its only remote
    # request); GPU 2 takes E1 (3), E2 (2). Every pick now has a local copy: loads are the row sums 10, 7, 7.
    extras, load = prefetch(FIG6, HOMES, 2, 1.0)
    assert extras.tolist() == [[4, 2], [0, -1], [1, 2]]
    assert load.tolist() == pytest.approx([10.0, 7.0, 7.0])
    # alpha = 0, n = 1: phase 2 only. Start: GPU 0 local E0 2 + E1 1 = 3, remote shares E0 1 (from GPU 1) +
    # E1 3 (GPU 2) -> 7; GPU 1 local 6, remote E2 5 + E3 0 -> 11; GPU 2 local 2, remote E4 4 -> 6. B = 8.
    # src GPU 1, e = E2 (5), dst = GPU 2 (6, the least loaded without E2): own 2, 6 + 2 <= 8. Localise 2 of 5
    # (GPU 1: 11 -> 9), GPU 2 -> 8; transfer min(3, 1, 0) = 0. Loads 7, 9, 8.
    # Pass 2: src GPU 1, e = E2 (3), dst = GPU 0 (7, the only one left without E2 and with room): own 3 -> stop.
    extras, load = prefetch(FIG6, HOMES, 1, 0.0)
    assert extras.tolist() == [[-1], [-1], [2]]
    assert load.tolist() == pytest.approx([7.0, 9.0, 8.0])


def test_locality_can_pin_load_on_one_gpu() -> None:
    # A consequence of phase 1 worth pinning: expert 0 lives on GPUs 0 and 2, only GPU 1's tokens want it (12).
    # Without extras those 12 remote picks split 6 / 6 over GPUs 0 and 2 (imbalance 6 / 4 = 1.5). Phase 1 copies
    # expert 0 onto GPU 1, which makes all 12 local there (imbalance 3), and phase 2 cannot undo it: GPU 1 has no
    # remote load to hand out. Libra trades balance for locality here.
    hosted = np.array([[True, False], [False, True], [True, False]])
    demand = np.array([[0, 0], [12, 0], [0, 0]])
    extras, load = prefetch(demand, hosted, 2, 0.5)
    assert extras.tolist() == [[-1, -1], [0, -1], [-1, -1]]
    assert load.tolist() == pytest.approx([0.0, 12.0, 0.0])
    extras, load = prefetch(demand, hosted, 2, 0.0)  # phase 2 only: the split is already even over the holders
    assert extras.tolist() == [[-1, -1], [-1, -1], [-1, -1]]
    assert load.tolist() == pytest.approx([6.0, 0.0, 6.0])


def test_phase1_ties_go_to_the_lower_id_and_skip_unrequested() -> None:
    hosted = np.array([[True, False, False, False], [False, True, True, True]])
    demand = np.array([[0, 5, 0, 5], [0, 0, 0, 0]])  # GPU 0: E1 and E3 tied, E2 never requested
    extras, _ = prefetch(demand, hosted, 3, 1.0)
    assert extras.tolist() == [[1, 3, -1], [-1, -1, -1]]
    extras, _ = prefetch(demand, hosted, 1, 1.0)
    assert extras.tolist() == [[1], [-1]]


def test_phase2_ties_go_to_the_lower_id_not_to_rounding() -> None:
    # Found by comparing with the exact reference: after four duplications the source is GPU 2 and its remote
    # shares of E1 and E8 are both 2/3 in exact arithmetic, reached along different float computations (E8: 2
    # remote picks / 3 copies; E1: 3 minus proportional cuts). The hottest-expert tie must go to E1 (the lower
    # id), which GPU 0 takes; picking E8 by rounding noise duplicates it onto GPU 1, which is already at B, so
    # the copy moves no load, and the next pass stops.
    demand = np.array([[0, 1, 2, 2, 0, 1, 1, 2, 0, 1], [1, 2, 2, 0, 1, 2, 0, 0, 0, 0],
                       [2, 1, 1, 0, 0, 0, 0, 0, 2, 2], [0, 0, 2, 0, 1, 0, 0, 2, 2, 0],
                       [2, 2, 1, 0, 0, 2, 1, 0, 2, 2]])
    hosted = np.array([[0, 0, 1, 1, 1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1, 0, 0, 1, 1],
                       [0, 0, 1, 1, 1, 1, 0, 0, 0, 1]], dtype=bool)
    extras, load = prefetch(demand, hosted, 4, 0.0)
    ref_extras, ref_load, _ = _reference(demand, hosted, 4, 0.0)
    assert ref_extras == [[0, 1], [1, 8], [], [6], [7]]
    assert _rows(extras) == ref_extras
    np.testing.assert_allclose(load, [float(v) for v in ref_load], atol=1e-9)


def test_docstring_example() -> None:
    hosted = np.array([[True, True, False, False], [False, False, True, True]])
    demand = np.array([[1, 0, 6, 2], [3, 0, 1, 1]])  # GPU 0 wants E2 most; GPU 1 wants E0
    extras, load = prefetch(demand, hosted, 2, 0.5)
    assert extras[0, 0] == 2 and extras[1, 0] == 0
    assert load.sum() == pytest.approx(demand.sum())


@pytest.mark.parametrize(("n", "alpha", "expected"), [(8, 0.5, 4), (3, 0.5, 1), (0, 0.7, 0), (5, 1.0, 5),
                                                     (5, 0.0, 0), (10, 0.3, 3), (3, 1 / 3, 1), (7, 0.99, 6)])
def test_phase1_count(n: int, alpha: float, expected: int) -> None:
    assert phase1_count(n, alpha) == expected


# ----------------------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(case=cases())
def test_properties(case: tuple[np.ndarray, np.ndarray, int, float]) -> None:
    demand, hosted, n, alpha = case
    G, E = demand.shape
    extras_arr, load = prefetch(demand, hosted, n, alpha)
    assert extras_arr.shape == (G, n)
    extras = _rows(extras_arr)
    L = phase1_count(n, alpha)
    total = float(demand.sum())
    B = total / G
    has = hosted.copy()
    for g, row in enumerate(extras):
        assert len(row) <= n
        assert len(set(row)) == len(row), f"GPU {g} got an expert twice: {row}"
        assert not any(hosted[g, e] for e in row), f"GPU {g} got an expert it already hosts: {row}"
        # phase 1: g's L most requested experts it does not hold, among those its tokens request
        wanted = sorted((e for e in range(E) if not hosted[g, e] and demand[g, e] > 0),
                        key=lambda e: (-demand[g, e], e))
        k1 = min(L, len(wanted))
        assert row[:k1] == wanted[:k1]
        has[g, row[:k1]] = True
        # phase 2: a GPU that received a balancing copy ends at or below B
        if len(row) > k1:
            assert load[g] <= B + 1e-9, (g, load, B)
    assert load.sum() == pytest.approx(total, abs=1e-9)
    assert (load >= -1e-9).all()
    if n == 0 or total == 0:
        assert extras == [[] for _ in range(G)]
    if L == n:  # alpha = 1 (or n = 0): no balancing slot
        assert all(len(row) == min(L, sum(1 for e in range(E) if not hosted[g, e] and demand[g, e] > 0))
                   for g, row in enumerate(extras))
    if all(len(row) == min(L, int(((~hosted[g]) & (demand[g] > 0)).sum())) for g, row in enumerate(extras)):
        # no phase-2 move: the loads are the plain split over the copies after phase 1
        np.testing.assert_allclose(load, _split_load(demand, has), atol=1e-9)
    # the whole algorithm against the exact reference
    ref_extras, ref_load, ref_phase1 = _reference(demand, hosted, n, alpha)
    assert extras == ref_extras
    np.testing.assert_allclose(load, [float(v) for v in ref_load], atol=1e-9)
    assert all(len(row) >= k for row, k in zip(extras, ref_phase1, strict=True))


@settings(max_examples=30, deadline=None)
@given(case=cases(), layers=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_prefetch_layers_is_prefetch_per_layer(case: tuple[np.ndarray, np.ndarray, int, float], layers: int,
                                              seed: int) -> None:
    demand, hosted, n, alpha = case
    rng = np.random.default_rng(seed)
    # more layers: the same base placement with rolled experts, and fresh demand
    d = np.stack([rng.permutation(demand, axis=1) for _ in range(layers)])
    h = np.stack([np.roll(hosted, i, axis=1) for i in range(layers)])
    got = prefetch_layers(d, h, n, alpha)
    assert got.shape == (layers, *demand.shape[:1], n)
    for layer in range(layers):
        np.testing.assert_array_equal(got[layer], prefetch(d[layer], h[layer], n, alpha)[0])


def test_fractional_demand_and_integer_like_inputs() -> None:
    # demand may be any non-negative real (predicted picks scaled to a batch); hosted may be 0/1 ints
    demand = FIG6 * 0.5
    extras, load = prefetch(demand, HOMES.astype(int), 2, 0.5)
    assert extras.tolist() == [[4, -1], [0, -1], [1, 2]]  # the same decisions, at half the scale
    assert load.tolist() == pytest.approx([3.5, 4.5, 4.0])
    extras, _ = prefetch(FIG6, HOMES, np.int64(2), 0.5)
    assert extras.tolist() == [[4, -1], [0, -1], [1, 2]]


# ----------------------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------------------


def _with(value: float) -> np.ndarray:
    d = FIG6.astype(float)
    d[1, 2] = value
    return d


@pytest.mark.parametrize(("demand", "hosted", "n", "alpha", "fragments"), [
    (FIG6[:, :5], HOMES, 2, 0.5, ("demand (3, 5)", "hosted (3, 6)", "[G, E]")),
    (FIG6[0], HOMES[0], 2, 0.5, ("[G, E]",)),
    (FIG6[None], HOMES[None], 2, 0.5, ("[G, E]",)),
    (_with(-1.0), HOMES, 2, 0.5, ("non-negative",)),
    (_with(np.nan), HOMES, 2, 0.5, ("finite",)),
    (_with(np.inf), HOMES, 2, 0.5, ("finite",)),
    (FIG6, np.where(np.arange(6) == 3, False, HOMES), 2, 0.5, ("expert 3", "no copy", "home")),
    (FIG6, HOMES, -1, 0.5, ("n (-1)", "non-negative integer")),
    (FIG6, HOMES, 1.5, 0.5, ("n (1.5)",)),
    (FIG6, HOMES, True, 0.5, ("n (True)",)),
    (FIG6, HOMES, 2, -0.1, ("alpha (-0.1)", "[0, 1]")),
    (FIG6, HOMES, 2, 1.5, ("alpha (1.5)", "[0, 1]")),
    (FIG6, HOMES, 2, float("nan"), ("alpha",)),
    (FIG6, HOMES, 2, "0.5", ("alpha",)),
])
def test_bad_inputs(demand: np.ndarray, hosted: np.ndarray, n: object, alpha: object,
                    fragments: tuple[str, ...]) -> None:
    with pytest.raises(InputError) as info:
        prefetch(demand, hosted, n, alpha)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_inputs_of_prefetch_layers() -> None:
    d = np.stack([FIG6, FIG6])
    h = np.stack([HOMES, HOMES])
    with pytest.raises(InputError, match=r"\[L, G, E\]"):
        prefetch_layers(FIG6, HOMES, 2, 0.5)
    with pytest.raises(InputError, match=r"\[L, G, E\]"):
        prefetch_layers(d, h[:, :, :5], 2, 0.5)
    h2 = h.copy()
    h2[1, :, 5] = False
    with pytest.raises(InputError, match="expert 5 has no copy in the base placement of layer 1"):
        prefetch_layers(d, h2, 2, 0.5)
    with pytest.raises(InputError, match="non-negative"):
        prefetch_layers(-d, h, 2, 0.5)
    with pytest.raises(InputError, match="alpha"):
        prefetch_layers(d, h, 2, 2.0)
    with pytest.raises(InputError, match="n "):
        prefetch_layers(d, h, -3, 0.5)
    # more extras than experts cannot be meant (and must not allocate a buffer of that size first)
    with pytest.raises(InputError, match=r"n \(7\) exceeds the 6 experts of a layer"):
        prefetch_layers(d, h, 7, 0.5)
    with pytest.raises(InputError, match=r"n \(4000000000\) exceeds the 6 experts"):
        prefetch(FIG6, HOMES, 4_000_000_000, 0.5)
    assert (prefetch(FIG6, HOMES, 6, 0.5)[0] >= -1).all()  # n = E is allowed
