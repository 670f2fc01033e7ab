"""hpcsgd.comm.stripes: every data rank owns a contiguous column range of every exchanged
matrix; per-rank state moves to another number of ranks without losing anything."""
import numpy as np
import pytest

from hpcsgd.comm.stripes import (fold_residuals, folded_from, restripe, stripe_of, stripe_ranges,
                                 unstripe)
from hpcsgd.model.flat import ParamSpec, matrices

MATS = matrices([("W0", (7, 5)), ("b0", (1, 5)), ("W1", (5, 3)), ("b1", (1, 3))])


@pytest.mark.parametrize("old_world, world", [(3, 2), (2, 4), (1, 3)])
def test_restripe_state_moves_every_owner_stripe_to_its_new_owner(old_world, world):
    mats = MATS
    full = np.arange(sum(m.size for m in mats), dtype=np.float32)
    old = {"velocity": [stripe_of(full, mats, r, old_world) for r in range(old_world)],
           "sqr": [np.zeros(1, np.float32)] * old_world}   # AdaGrad off: placeholder
    for rank in range(world):
        got = restripe(old, old_world, True, mats, rank, world, striped=True)
        want = np.concatenate([full[lo:hi] for lo, hi in stripe_ranges(mats, rank, world)])
        np.testing.assert_array_equal(got["velocity"], want)
        assert got["sqr"].size == 1
    np.testing.assert_array_equal(restripe(old, old_world, True, mats, 0, world,
                                           striped=False)["velocity"], full)


@pytest.mark.parametrize("old_world, world", [(2, 3), (3, 2), (4, 1), (1, 4)])
def test_folded_residuals_keep_what_no_rank_has_sent(old_world, world):
    """Over the new ranks, the sum of the first residuals and the second residuals laid back
    into the full vector equal the old ones: the error feedback loses nothing."""
    rng = np.random.default_rng(old_world * 10 + world)
    size = sum(m.size for m in MATS)
    old1 = [rng.standard_normal(size).astype(np.float32) for _ in range(old_world)]
    full2 = rng.standard_normal(size).astype(np.float32)
    old2 = [stripe_of(full2, MATS, r, old_world) for r in range(old_world)]
    new = [fold_residuals([old1[k] for k in folded_from(r, old_world, world)], old2, MATS,
                          old_world, r, world) for r in range(world)]
    np.testing.assert_allclose(sum(r1 for r1, _ in new), sum(old1), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(unstripe([r2 for _, r2 in new], MATS, world), full2)
    for r, (_, r2) in enumerate(new):
        assert r2.size == sum(hi - lo for lo, hi in stripe_ranges(MATS, r, world))


def test_parameters_not_exchanged_have_no_stripe():
    mats = matrices([ParamSpec("W", (4, 2)), ParamSpec("frozen", (3, 2), exchange="none")])
    full = np.arange(14, dtype=np.float32)
    assert sum(stripe_of(full, mats, r, 2).size for r in range(2)) == 8
