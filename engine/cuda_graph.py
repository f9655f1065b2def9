"""One CUDA graph for a whole frame, replayed every tick; fails loudly on misuse.

Why: an eager frame is hundreds of tiny kernel launches (Mimi alone), which costs more than
the math at small batch. A graph replays them all with one launch. What a graph needs:
fixed shapes (each graph has its own fixed row count), no host syncs inside, and every
per-row setting (live mask, sampling) read from device tensors, so changes made after
capture are seen on replay.

Capture happens once per graph (the backend has one per row bucket), at backend construction,
with an all-False live mask: by the model
contract those rows' state is untouched, so warm-up and capture cannot disturb a session.
On replay the inputs are copied into the captured buffers; a shape, dtype or device that
differs from capture raises `GraphError` instead of silently reading stale memory.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

DISABLE_HINT = "build the backend with cuda_graphs=False to run eagerly and see the real error"


def sync_device(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for off CUDA): what a cost measured on
    the host must include."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GraphError(RuntimeError):
    """A CUDA graph was replayed with inputs unlike those it was captured with."""


class CUDAGraphRunner:
    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], example_inputs: Sequence[torch.Tensor],
                 warmup_steps: int = 2, pool: tuple | None = None,
                 capture_stream: "torch.cuda.Stream | None" = None,
                 generators: Sequence[torch.Generator] = ()) -> None:
        # pool: a torch.cuda.graph_pool_handle() shared with graphs that never replay concurrently.
        # capture_stream: give each of several graphs its own (graphs captured through the shared
        # default capture stream share its cuBLAS workspace, which hung concurrent replays).
        # generators: CUDA generators other than the default that `fn` draws from (a model with its
        # own random stream); each replay advances them as the eager calls would.
        if not all(t.is_cuda for t in example_inputs):
            raise GraphError("CUDA graphs need every input on a CUDA device; on CPU the backend runs eagerly.")
        self._signature = [(tuple(t.shape), t.dtype, t.device) for t in example_inputs]
        self._inputs = [t.clone() for t in example_inputs]
        # Warm up on a side stream (lazy inits, cuBLAS workspaces) before capture, as PyTorch asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                fn(*self._inputs)
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        for generator in generators:
            self._graph.register_generator_state(generator)
        try:
            with torch.cuda.graph(self._graph, pool=pool, stream=capture_stream):
                self._outputs = tuple(fn(*self._inputs))
        except Exception as exc:
            raise GraphError(f"capturing the frame in a CUDA graph failed ({exc}); {DISABLE_HINT}.") from exc

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(inputs) != len(self._signature):
            raise GraphError(f"the CUDA graph takes {len(self._signature)} inputs, got {len(inputs)}; {DISABLE_HINT}.")
        for i, (tensor, (shape, dtype, device)) in enumerate(zip(inputs, self._signature)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise GraphError(f"CUDA graph input {i} was captured as {list(shape)} {dtype}, got "
                                 f"{list(tensor.shape)} {tensor.dtype}; shapes must stay as "
                                 f"captured; {DISABLE_HINT}.")
            if tensor.is_cuda and tensor.device != device:
                raise GraphError(f"CUDA graph input {i} is on {tensor.device}, captured on {device}; {DISABLE_HINT}.")
        for static, tensor in zip(self._inputs, inputs):
            static.copy_(tensor, non_blocking=True)
        self._graph.replay()
        # The outputs are the graph's own buffers: read them before the next replay.
        return self._outputs

    def close(self) -> None:
        self._graph.reset()
        self._inputs.clear()
        self._outputs = ()
