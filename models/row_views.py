"""Views of the lowest rows of a per-row state, so a step can run on fewer rows than exist.

    view = leading_rows(state, n)   # the same kind of state, every tensor sliced to rows [0, n)

Every per-row state in `models/` keeps its rows on dim 0 of each tensor (TransformerState,
LMGenState, the Mimi states); a state laid out otherwise (TtsGen, DsmRows) has a
`leading_rows(n)` method of its own, which this calls. The slices are views: a step over `view`
updates rows [0, n) of `state` in place and never touches the rows above. The engine allocates rows lowest first, so
a step over the lowest rows that hold every live session costs what those rows cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from parley.models.mimi.conv import StateList


def leading_rows(state: Any, n: int) -> Any:
    if isinstance(state, torch.Tensor):
        return state[:n]
    if callable(getattr(state, "leading_rows", None)):  # its own rule
        return state.leading_rows(n)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: leading_rows(getattr(state, f.name), n)
                                             for f in dataclasses.fields(state) if f.init})
    if isinstance(state, StateList):
        return StateList([leading_rows(s, n) for s in state.states])
    if isinstance(state, (list, tuple)):
        return type(state)(leading_rows(s, n) for s in state)
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(f"leading_rows: no rule for {type(state).__name__}")
