"""The statistics launch's blocks: every chunk walked, by warps that each walk the same number of chunks.

Runs without a GPU: the grid is a function of the chunk count and the device's grid only.
"""

from __future__ import annotations

import pytest

device_stats = pytest.importorskip("cupy_amp.gpu.stats")
WARPS = device_stats._WARPS_PER_BLOCK


@pytest.mark.parametrize("grid", [1, 2, 264, 1056])
@pytest.mark.parametrize("chunks", [1, 15, 16, 17, 148, 4224, 4225, 5000, 7600, 95_000, 1_000_003])
def test_every_chunk_is_walked_in_the_fewest_rounds_with_no_warp_short_of_a_round(grid: int, chunks: int) -> None:
    blocks = device_stats._stats_blocks(chunks, grid)
    warps = blocks * WARPS
    rounds = -(-chunks // warps)  # the kernel: warp w walks chunks w, w + warps, ...
    assert 1 <= blocks <= grid
    assert rounds == -(-chunks // (grid * WARPS))  # no more rounds than the full grid would take
    # Only the last block's spare warps go without a chunk in a round: 5000 chunks on 264 blocks would
    # otherwise leave 3448 of 4224 warps idle in the second round.
    assert warps * rounds - chunks < WARPS * rounds


def test_a_group_without_chunks_launches_no_block() -> None:
    assert device_stats._stats_blocks(0, 264) == 0


def test_the_blocks_depend_on_the_chunk_count_and_grid_alone() -> None:
    assert [device_stats._stats_blocks(5000, 264) for _ in range(3)] == [157, 157, 157]
