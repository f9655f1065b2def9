"""A frame backend for a server with no duplex model (TTS only): every session is refused with a
clear reason, so the engine runs only slack work (the TTS pool) and the duplex routes say why."""

from __future__ import annotations

import torch

from .backend import BackendOutput, SessionRejected
from .config import SamplingOptions, SessionOptions
from .cuda_graph import sync_device

NO_DUPLEX_REASON = "this server has no duplex model loaded (start it with --model); it serves TTS only"


class NoDuplexBackend:
    max_sessions = 1  # the engine's smallest table; the row never goes live

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        raise RuntimeError("NoDuplexBackend never has a live row")

    def reset_rows(self, mask: torch.Tensor) -> None:
        pass

    def set_sampling(self, row: int, sampling: SamplingOptions) -> None:
        pass

    def start_prefill(self, row: int, options: SessionOptions):
        raise SessionRejected(NO_DUPLEX_REASON)

    def warm_up_prefill(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        return ()

    def text_piece(self, token: int) -> str:
        return ""

    def synchronize(self) -> None:
        sync_device(self.device)

    def close(self) -> None:
        pass
