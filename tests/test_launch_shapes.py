"""Launch shapes of the CUDA kernels (pure functions of the array sizes: no GPU, no simulator):
every element gets one thread, no block is idle, and where the array allows it the launch
has 2 blocks per SM of an H100 (census.FILL_BLOCKS), where numba-cuda stops warning about
under-utilization (128 blocks) and the SMs all get work. The warning itself is turned off on
GPU ranks for what stays small (comm/gpu.py: quiet_small_grids), and only that warning."""
import warnings

import pytest
from numba.core.errors import NumbaPerformanceWarning

from hpcsgd.census import FILL_BLOCKS
from hpcsgd.device import one_thread_each
from hpcsgd.model.kernels_cuda import MAX_GRID, _elem_launch


@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 1000, 10240, FILL_BLOCKS * 32 - 1,
                               FILL_BLOCKS * 32, 131072, 45_000_000])
def test_one_thread_each_covers_exactly_and_fills_when_it_can(n):
    blocks, threads = one_thread_each(n)
    assert blocks * threads >= n > (blocks - 1) * threads     # no idle block
    assert threads <= 256 and (threads >= 32 or threads == n)  # a warp, unless n is smaller
    if n >= FILL_BLOCKS * 32:
        assert blocks >= FILL_BLOCKS
    if n >= FILL_BLOCKS * 256:
        assert threads == 256                                   # big arrays keep big blocks


@pytest.mark.parametrize("n,m", [(256, 40), (256, 512), (1024, 2048), (8, 5), (3, 1),
                                 (100_000, 9304)])
def test_elementwise_launch_covers_the_matrix_and_fills_when_it_can(n, m):
    (gx, gy), (bx, by) = _elem_launch(n, m)
    assert bx <= 32 and by <= 8 and bx == min(32, m)
    # grid-stride beyond MAX_GRID; else every element has a thread, no block row idle
    assert min(gx * bx, MAX_GRID * bx) >= min(m, MAX_GRID * bx) and gy <= MAX_GRID
    assert gy * by >= min(n, MAX_GRID * by) and (gy - 1) * by < n
    if n * -(-m // 32) >= FILL_BLOCKS:       # one-row blocks would fill it: so do these
        assert gx * gy >= FILL_BLOCKS
    assert _elem_launch(256, 40) == ((2, 256), (32, 1))         # the demo's output layer


def test_gpu_ranks_silence_only_the_grid_size_warning():
    from hpcsgd.comm.gpu import quiet_small_grids
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_small_grids()
        warnings.warn(NumbaPerformanceWarning("Grid size 2 will likely result in GPU "
                                              "under-utilization due to low occupancy."))
        warnings.warn(NumbaPerformanceWarning("Host array used in CUDA kernel will incur "
                                              "copy overhead"))
    assert [str(w.message)[:10] for w in seen] == ["Host array"]


@pytest.mark.parametrize("m", [1, 5, 40, 512, 2048, 9304])
def test_column_sums_fill_more_blocks_with_narrower_tiles(m):
    from hpcsgd.model.kernels_cuda import COL_TILE, SUM_LANES, column_sums_launch
    blocks, (tile, lanes) = column_sums_launch(m)
    assert lanes == SUM_LANES and blocks * tile >= m > (blocks - 1) * tile
    assert tile == min(COL_TILE, m) or tile >= 8
    assert column_sums_launch(2048) == (256, (8, SUM_LANES))
    assert column_sums_launch(9304)[1][0] == 32             # wide enough already
