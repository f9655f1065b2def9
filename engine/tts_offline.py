"""One TTS request run to the end without a clock (`parley tts`, tests): the pool's own items,
back to back, on the calling thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from .slack import CostModel
from .stream import Terminal
from .tts_pool import TtsAudio, TtsPool, TtsRequest, TtsWord


@dataclass
class TtsResult:
    pcm: np.ndarray  # float32, 24 kHz mono
    words: list[TtsWord] = field(default_factory=list)
    terminal: Terminal | None = None


def synthesize(pool: TtsPool, request: TtsRequest) -> TtsResult:
    """Run `request` on an otherwise idle pool until its terminal event."""

    async def run() -> TtsResult:
        job = pool.submit(request, asyncio.get_running_loop())
        costs = CostModel()
        frames: list[np.ndarray] = []
        result = TtsResult(pcm=np.zeros(0, dtype=np.float32))
        while result.terminal is None:
            item = pool.offer(None, costs)
            if item is not None:
                try:
                    item.run()
                except Exception as exc:  # the request's failure, as the slack runner would report it
                    item.fail(exc)
            for event in job.stream.drain():
                if isinstance(event, TtsAudio):
                    frames.append(event.pcm)
                elif isinstance(event, TtsWord):
                    result.words.append(event)
                elif isinstance(event, Terminal):
                    result.terminal = event
            if item is None and result.terminal is None:
                await asyncio.sleep(0)
        if frames:
            result.pcm = np.concatenate(frames)
        return result

    return asyncio.run(run())
