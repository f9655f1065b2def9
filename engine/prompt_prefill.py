"""PersonaPlex prompts, run apart from the live rows and handed to the session's row at the end.

A prompt (voice, silence, persona, silence: ~170 frames) runs through the temporal
transformer in chunks on a batch-of-one state of its own (`LMGen.prompt_state`), one prompt
at a time, starting at position 0; its last chunk copies the filled slots into the
session's row (`LMGen.adopt_prompt`), leaving the row as a prefill on the row itself would.

Why a state of its own: its tensors never move, so each chunk size class (`PREFILL_CHUNKS`)
is one CUDA graph, and a chunk is one launch. An eager chunk launches every layer's kernels
(matmuls, rope, ring writes, masked attention) from the engine thread, which under a burst of
connecting clients competes for the GIL with the event loop: with many PersonaPlex sessions
opening at once, eager chunks cost several times their GPU time and made ticks late. A chunk shorter than its class is padded to it: the padding frames come
after the real ones, so causal attention keeps them out of every real frame, their keys sit
in slots the next chunk rewrites before any real frame reads them, and the row never takes
them (`adopt_prefix` copies only the real positions). A chunk that has no class, or whose
padding would wrap the ring (a prompt near the context length), runs eagerly at its length.
"""

from __future__ import annotations

from typing import Callable

import torch

from parley.models.lm_gen import LMGen, LMGenState

from .cuda_graph import CUDAGraphRunner

PREFILL_CHUNKS = (8, 16, 32, 64, 128, 256)  # chunk size classes (frames): a graph and a cost key each


def chunk_class(frames: int) -> int:
    """The class a chunk of `frames` frames runs as and is costed under: the smallest holding it
    (the largest for longer chunks, which run eagerly)."""
    return next((c for c in PREFILL_CHUNKS if c >= frames), PREFILL_CHUNKS[-1])


class PromptRunner:
    """The prompt state, its graphs (one per chunk class, on CUDA), and which prompt holds it."""

    def __init__(self, gen: LMGen, kv_dtype: torch.dtype | None = None, *, graphs: bool = False,
                 pad: bool | None = None) -> None:
        # graphs: capture one CUDA graph per chunk class (CUDA only). pad: run chunks padded to
        # their class (default: with graphs; on CPU it tests the padding without them).
        self._gen = gen
        self._state = gen.prompt_state(kv_dtype)
        self._capacity = self._state.slot_pos.shape[1]
        self._pad = graphs if pad is None else pad
        self._owner: object | None = None
        self._graphs: dict[int, CUDAGraphRunner] = {}
        if graphs:
            param = next(gen.model.parameters())
            pool = torch.cuda.graph_pool_handle()  # the prompt graphs never run at once: one pool
            for c in PREFILL_CHUNKS:
                if c <= self._capacity:
                    x = torch.zeros(1, c, gen.model.cfg.dim, device=param.device, dtype=param.dtype)
                    self._graphs[c] = CUDAGraphRunner(self._pass, (x,), pool=pool)
            self._state.clear()  # the captures' warm-up passes ran on it

    def _pass(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self._gen.model.transformer(x, self._state),)

    @torch.no_grad()
    def begin(self, owner: object) -> None:
        """`owner`'s prompt starts: the state is its own, from position 0 (a prompt left half
        done, e.g. by a session closed mid-prompt, is dropped)."""
        self._owner = owner
        self._state.clear()

    @torch.no_grad()
    def run(self, owner: object, start: int, inputs: torch.Tensor) -> None:
        """The next chunk of `owner`'s prompt: inputs [n, dim], the temporal inputs of positions
        start .. start + n - 1."""
        if self._owner is not owner:
            raise RuntimeError("another prompt took the prompt state: prompts run one at a time")
        n = inputs.shape[0]
        c = chunk_class(n)
        if not (self._pad and n <= c and start + c <= self._capacity):
            self._pass(inputs[None])
            return
        x = inputs.new_zeros(1, c, inputs.shape[1])
        x[0, :n] = inputs
        (self._graphs.get(c) or self._pass)(x)
        if c > n:  # the padding's positions are the next chunk's
            self._state.pos.sub_(c - n)

    @torch.no_grad()
    def adopt(self, owner: object, lm_state: LMGenState, row: int, frames: int,
              ring_tokens: torch.Tensor | None) -> None:
        """`owner`'s prompt is done: `row` takes its `frames` frames and these ring tokens."""
        if self._owner is not owner:
            raise RuntimeError("another prompt took the prompt state: prompts run one at a time")
        self._gen.adopt_prompt(lm_state, row, self._state, frames, ring_tokens)
        self._owner = None

    @torch.no_grad()
    def warm_up(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """Run one chunk of each of these lengths (of the model's initial tokens) and forget it:
        kernels loaded, matmul algorithms chosen, a graph's first replay done. Returns the
        lengths run (those that fit the ring)."""
        ran = tuple(frames for frames in chunks if frames <= self._capacity)
        initial = self._gen.embed_frames(self._gen.initial[None])  # [1, dim]
        owner = object()
        for frames in ran:
            self.begin(owner)
            self.run(owner, 0, initial.expand(frames, -1))
        self._owner = None
        self._state.clear()
        return ran

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()


class PromptPrefill:
    """One row's prompt as the engine runs it: chunk by chunk (each attends over the ones before,
    like an LLM prompt in pieces), handed to the row by `finish(job, frames)` after the last."""

    def __init__(self, runner: PromptRunner | None, inputs: torch.Tensor | None,
                 finish: Callable[[PromptPrefill, int], None] | None) -> None:
        # inputs None: nothing to prefill (Moshi); the job is done from the start.
        self._runner, self._inputs, self._finish = runner, inputs, finish
        self._done = 0
        self.frames_left = 0 if inputs is None else inputs.shape[0]

    @torch.no_grad()
    def run(self, max_frames: int | None = None) -> None:
        n = self.frames_left if max_frames is None else min(max_frames, self.frames_left)
        if n <= 0:
            return
        # Chunks of at least 2 frames: a 1-frame chunk would take the T == 1 decode path, which
        # is built for whole-batch steps, not for prompts.
        n = min(self.frames_left, max(n, 2))
        if self.frames_left - n == 1:
            n += 1
        if self._done == 0:
            self._runner.begin(self)
        self._runner.run(self, self._done, self._inputs[self._done:self._done + n])
        self._done += n
        self.frames_left -= n
        if self.frames_left == 0:
            self._finish(self, self._done)
