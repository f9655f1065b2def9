"""The row-bucket step (engine/bucketed_step.py): bucket choice, views of the lowest rows, eager and
graphed runs. The duplex frame, the TTS pool and both STT paths run on it; their own tests cover
it with real models (test_row_buckets, test_tts_buckets, test_stt_graphs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from parley.engine.bucketed_step import BucketedStep, bucket_for, bucket_sizes
from parley.engine.cuda_graph import GraphError
from parley.models.row_views import leading_rows


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_bucket_for_is_the_smallest_bucket_holding_every_row():
    buckets = [1, 2, 4, 8]
    assert bucket_for(buckets, []) == 1  # no row: the smallest
    assert bucket_for(buckets, [0]) == 1
    assert bucket_for(buckets, [1]) == 2
    assert bucket_for(buckets, [0, 2]) == 4
    assert bucket_for(buckets, iter([5, 1])) == 8
    assert bucket_for([8], [0]) == 8  # buckets off: every step runs all rows
    with pytest.raises(ValueError, match="row 8 is outside the 8 rows"):
        bucket_for(buckets, [8])


@dataclass
class Rows:
    """A per-row state as models/ keeps them: rows on dim 0."""

    count: torch.Tensor  # [B] long
    last: torch.Tensor  # [B, 2] float


class ColumnRows:
    """A state whose rows are columns ([2, B]), viewed by a method of its own (as TtsGen is)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def leading_rows(self, n: int) -> "ColumnRows":
        return ColumnRows(self.table[:, :n])


def count_step(rows: Rows, columns: ColumnRows, x: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Live rows count a step and keep their input; returns every row's count times its input."""
    rows.count.add_(live.long())
    rows.last.copy_(torch.where(live[:, None], x, rows.last))
    columns.table.add_(live.long())
    return (rows.count * x[:, 0], rows.count.clone())


def make(max_rows: int = 8, device: str = "cpu") -> tuple[BucketedStep, Rows, ColumnRows]:
    rows = Rows(torch.zeros(max_rows, dtype=torch.long, device=device), torch.zeros(max_rows, 2, device=device))
    columns = ColumnRows(torch.zeros(2, max_rows, dtype=torch.long, device=device))
    return BucketedStep(count_step, (rows, columns), bucket_sizes(max_rows)), rows, columns


def test_eager_step_runs_on_views_of_the_lowest_rows_and_leaves_the_others():
    step, rows, columns = make()
    assert step.buckets == [1, 2, 4, 8] and not step.graphed
    n = step.bucket([0, 2])
    x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 1
    live = torch.tensor([True, False, True, False])
    product, count = step(n, x, live)
    assert product.shape == (4,) and product.device == x.device
    assert count.tolist() == [1, 0, 1, 0]
    assert torch.equal(product, torch.tensor([1.0, 0.0, 5.0, 0.0]))
    # The step wrote through its views into the state's lowest rows, and nowhere else.
    assert rows.count.tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    assert torch.equal(rows.last[:4], torch.where(live[:, None], x, torch.zeros(4, 2))) and not rows.last[4:].any()
    assert columns.table.tolist() == [[1, 0, 1, 0, 0, 0, 0, 0]] * 2
    # A row above the bucket changes only in a bucket that holds it.
    step(8, torch.ones(8, 2), torch.arange(8) == 7)
    assert rows.count.tolist() == [1, 0, 1, 0, 0, 0, 0, 1]


def test_a_bucket_step_equals_the_same_rows_of_a_whole_step():
    """On the same device the lowest rows of a bucket step are those of a step of all rows, bit
    for bit (this function has no batch-size dependent rounding)."""
    bucketed, rows_a, _ = make()
    whole = BucketedStep(count_step, (Rows(rows_a.count.clone(), rows_a.last.clone()),
                                      ColumnRows(torch.zeros(2, 8, dtype=torch.long))), [8])
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    live = torch.tensor([True, True, False, False, False, False, False, False])
    a = bucketed(2, x[:2], live[:2])
    b = whole(8, x, live)
    assert all(torch.equal(p, q[:2]) for p, q in zip(a, b))


def test_views_alias_the_state():
    step, rows, columns = make()
    views = step.eager(4).args  # (the bound views of bucket 4)
    assert views[0].count.data_ptr() == rows.count.data_ptr() and views[0].count.shape == (4,)
    assert views[0].last.shape == (4, 2) and views[1].table.shape == (2, 4)
    assert views[1].table.data_ptr() == columns.table.data_ptr()
    assert leading_rows(columns, 2).table.shape == (2, 2)  # row_views uses a state's own rule


def test_unknown_bucket_and_cpu_capture_are_refused():
    step, rows, _ = make()
    with pytest.raises(ValueError, match=r"no step over 3 rows: the buckets are \[1, 2, 4, 8\]"):
        step(3, torch.zeros(3, 2), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(GraphError, match="CUDA device"):
        step.capture(lambda n: (torch.zeros(n, 2), torch.zeros(n, dtype=torch.bool)))
    assert not step.graphed and step.pool is None
    step(1, torch.ones(1, 2), torch.ones(1, dtype=torch.bool))  # still runs, eagerly
    assert rows.count.tolist()[:2] == [1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_replay_what_the_eager_steps_compute_on_the_gpu():
    """Each bucket's graph (captured largest first, two steps on one pool) computes what the eager
    step computes, on the same rows, and leaves the rows above alone."""
    def idle(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, 2, device="cuda"), torch.zeros(n, dtype=torch.bool, device="cuda")

    def run(graphs: bool) -> list:
        step, rows, columns = make(device="cuda")
        other = BucketedStep(count_step, (rows, columns), step.buckets)  # the same step, a second set of graphs
        if graphs:
            pool = step.capture(idle)
            assert other.capture(idle, pool=pool) is pool and step.graphed and step.graph(1) is not None
        outs = []
        for t, n in enumerate([1, 4, 2, 8, 4]):
            x = torch.randn(n, 2, generator=torch.Generator().manual_seed(t)).cuda()
            live = (torch.arange(n) % 2 == t % 2).cuda()
            outs.append([o.cpu().clone() for o in (step if t % 2 else other)(n, x, live)])
        step.close()
        other.close()
        return outs + [[rows.count.cpu(), rows.last.cpu(), columns.table.cpu()]]

    eager, graphed = run(False), run(True)
    assert rows_changed(eager[-1])  # (the steps did write the state)
    for a, b in zip(eager, graphed, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def rows_changed(state: list[torch.Tensor]) -> bool:
    return all(t.any() for t in state)
