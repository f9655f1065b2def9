"""The KV block pool's changes (engine/kv_blocks.py) written into a paged transformer state
(models/paged_kv.py): what `ModelBackend.map_kv_blocks` does between two ticks."""

from __future__ import annotations

from .kv_blocks import KvChanges


def map_kv_changes(state, changes: KvChanges) -> None:
    """`changes` into `state` (a paged TransformerState) in their order, through the state's own
    methods, each in place (the captured graphs read the block table and slot positions where they
    are): released rows start over with no block; a forgotten block's slots are emptied (never
    attended) and its entry goes back to the null block; then the new blocks, a row's in one call."""
    for row in changes.released:
        state.release_row(row)
    forgotten: dict[int, list[int]] = {}
    for row, logical in changes.forgotten:
        forgotten.setdefault(row, []).append(logical)
    for row, logical in forgotten.items():
        state.forget_blocks(row, logical)
    assigned: dict[int, tuple[list[int], list[int]]] = {}
    for row, logical, physical in changes.assigned:
        pair = assigned.setdefault(row, ([], []))
        pair[0].append(logical)
        pair[1].append(physical)
    for row, (logical, physical) in assigned.items():
        state.assign_blocks(row, logical, physical)
