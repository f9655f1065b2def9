"""engine/host_rows.py: the engine's per-row audio moved through bytes copies (no numpy copy per row)."""

from __future__ import annotations

import numpy as np
import pytest

from parley.engine.host_rows import join_rows, row_copy

N = 1920


def test_join_rows_places_each_part_and_silence_where_none():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    out = join_rows([a, None, b.tobytes(), None], N)
    assert out.shape == (4, N) and out.dtype == np.float32 and out.flags.writeable
    np.testing.assert_array_equal(out[0], a)
    np.testing.assert_array_equal(out[2], b)
    assert not out[1].any() and not out[3].any()
    out[0] = 0.0  # the joined array is a copy: the part is untouched
    assert a.any()


def test_join_rows_refuses_a_part_of_the_wrong_length():
    with pytest.raises(ValueError):
        join_rows([np.zeros(N - 1, np.float32), None], N)


def test_row_copy_is_an_independent_writable_copy():
    host = np.arange(3 * N, dtype=np.float32).reshape(3, N)
    copy = row_copy(host[1])
    assert copy.shape == (N,) and copy.dtype == np.float32 and copy.flags.writeable
    assert not np.shares_memory(copy, host)
    copy[:] = -1.0
    np.testing.assert_array_equal(host[1], np.arange(N, 2 * N, dtype=np.float32))
