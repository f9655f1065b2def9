"""A prefilled row's last prompt frame, the "handoff", which runs inside the row's next regular tick.

`ModelBackend` (engine/backend.py) runs a PersonaPlex prompt as batched passes (engine/prompt_prefill.py)
except its last frame: that one rides in the row's first regular tick, its tokens forced and its user
codes replaced by the prompt's, so a prefill costs no extra step. The tensors here are inputs of the
frame (and of every row bucket's CUDA graph), written in place between ticks; "not generated" (-2) and
False mean nothing pending.
"""

from __future__ import annotations

from typing import Callable

import torch

from parley.models.config import UNGENERATED_TOKEN, LMConfig
from parley.models.persona_prompt import PromptPlan


class PromptHandoff:
    """Per row: the text and audio tokens to force and the user codes to read in the handoff frame."""

    def __init__(self, rows: int, cfg: LMConfig, device: torch.device,
                 device_mask: Callable[[set[int]], torch.Tensor]) -> None:
        self._device = device
        self._device_mask = device_mask  # rows -> a [rows] bool mask on the device
        self.force_text = torch.full((rows,), UNGENERATED_TOKEN, dtype=torch.long, device=device)
        self.force_audio = torch.full((rows, cfg.n_agent), UNGENERATED_TOKEN, dtype=torch.long, device=device)
        self.prompt_user = torch.zeros(rows, cfg.n_user, dtype=torch.long, device=device)
        self.prompt_mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self.rows: set[int] = set()  # rows whose handoff frame is still to run

    def inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """The frame's handoff inputs for the lowest `n` rows (views: a captured graph reads them in place)."""
        return self.force_text[:n], self.force_audio[:n], self.prompt_user[:n], self.prompt_mask[:n]

    def clear(self, rows: set[int]) -> None:
        """Drop the pending handoff of `rows` (stepped, or closed before their tick)."""
        self.forget(rows)
        self.clear_device(self._device_mask(rows))

    def forget(self, rows: set[int]) -> None:
        """The host half of `clear`: `rows` have no handoff frame to run."""
        self.rows -= rows

    def clear_device(self, mask: torch.Tensor) -> None:
        """The device half of `clear` (`mask` [rows] bool on the device): no host sync, so a
        reset's CUDA graph runs it (engine/row_reset.py)."""
        self.force_text.masked_fill_(mask, UNGENERATED_TOKEN)
        self.force_audio.masked_fill_(mask[:, None], UNGENERATED_TOKEN)
        self.prompt_mask.masked_fill_(mask, False)

    def arm(self, row: int, plan: PromptPlan) -> None:
        """The prompt's last frame runs in the row's first tick (see ModelBackend._frame); it outputs
        the last silence frame, which PersonaPlex too sends first after the handshake."""
        self.force_text[row] = plan.first_step_force_text
        self.force_audio[row] = plan.first_step_force_audio.to(self._device)
        self.prompt_user[row] = plan.first_step_user.to(self._device)
        self.prompt_mask[row] = True
        self.rows.add(row)
