"""Text tokens forced into rows' text streams (spoken commentary): per-row queues on the device.

    forced = ForcedText.empty(batch, capacity, device)   # LMGenState.forced
    forced.push(row, ids)                                 # host, between steps; False: queue full
    text = forced.apply(sampled, exec_mask, pauses)       # inside LMGen.step, after sampling

A row's queued tokens replace its sampled text tokens one per frame, from the row's next pause
(a sampled PAD or EPAD: the model is between words, so no word of its own is cut) and then on
every frame until the queue is empty, so a forced phrase is contiguous. The forced token goes
where a sampled one would (the ring, the depformer's input), so the model's speech can follow
it as it follows its own inner monologue. Rows with nothing queued get the sampled token back,
bit for bit. `apply` is fixed-shape tensor work with no host sync, so it runs inside a frame's
CUDA graph; `push` reads the row's count back (one small sync), between ticks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import UNGENERATED_TOKEN

FORCED_TEXT_CAPACITY = 2048  # tokens a row can have waiting (four appends of 500 tokens, and more)


@dataclass
class ForcedText:
    tokens: torch.Tensor  # [B, Q] long: a ring of queued token ids per row
    written: torch.Tensor  # [B] long: tokens ever queued on the row (next write at written % Q)
    taken: torch.Tensor  # [B] long: tokens ever forced (next read at taken % Q)
    streak: torch.Tensor  # [B] bool: the row forced a token at its last step (goes on without a pause)

    @classmethod
    def empty(cls, batch_size: int, capacity: int, device: torch.device | str) -> "ForcedText":
        def zeros(dtype):
            return torch.zeros(batch_size, dtype=dtype, device=device)

        return cls(tokens=torch.full((batch_size, capacity), UNGENERATED_TOKEN, dtype=torch.long, device=device),
                   written=zeros(torch.long), taken=zeros(torch.long), streak=zeros(torch.bool))

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def pending(self, row: int) -> int:
        """Tokens queued on `row` and not forced yet (reads the device: a sync)."""
        return int(self.written[row] - self.taken[row])

    def push(self, row: int, ids: list[int]) -> bool:
        """Queue `ids` behind what `row` already has; False (nothing queued) if they do not fit."""
        if not ids:
            return True
        if self.pending(row) + len(ids) > self.capacity:
            return False
        device = self.tokens.device
        slots = (self.written[row] + torch.arange(len(ids), device=device)) % self.capacity
        self.tokens[row, slots] = torch.tensor(ids, dtype=torch.long, device=device)
        self.written[row] += len(ids)
        return True

    def apply(self, sampled: torch.Tensor, exec_mask: torch.Tensor, pauses: torch.Tensor) -> torch.Tensor:
        """The rows' text tokens for this step: the queue's head where a row forces, else `sampled`.
        pauses [P]: the text ids that mark a pause. Rows outside `exec_mask` keep their queue."""
        head = self.tokens.gather(1, (self.taken % self.capacity)[:, None])[:, 0]
        at_pause = (sampled[:, None] == pauses[None]).any(dim=1)
        force = exec_mask & (self.written > self.taken) & (self.streak | at_pause)
        self.taken.add_(force.long())
        self.streak.copy_(torch.where(exec_mask, force, self.streak))
        return torch.where(force, head, sampled)

    def reset(self, mask: torch.Tensor) -> None:
        """Masked rows drop their queue (a new session on the row starts with none)."""
        self.written.masked_fill_(mask, 0)
        self.taken.masked_fill_(mask, 0)
        self.streak.masked_fill_(mask, False)
