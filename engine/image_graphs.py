"""The image items captured as CUDA graphs at warm-up, by cost key (engine/image_queue.py).

Captured: the denoise step of each warmed bucket (width, height, cfg, batch), each on its own
capture stream; the text encoder(s) once (prompts pad to one token shape, so one graph serves
every encode); the preview and whole decode of each warmed size (their latents' shape is fixed by
the size). Every other key runs eagerly, as does everything on the CPU or after a failed capture
(logged once, as a warning). A replay returns copies of the graph's outputs: the graph's buffers
are overwritten by its next replay, and callers keep outputs (schedulers, the negative-prompt
cache, images).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch


from .cuda_graph import CUDAGraphRunner, GraphError
from .image_costs import encode_key

if TYPE_CHECKING:  # diffusers loads only with an image model (models/image_pipeline.py)
    from parley.models.image_pipeline import ImageJob, ImageStepper

log = logging.getLogger("parley.engine.images")


class ImageGraphs:
    """Replays by item key (`get`), captured by the warm-up (`capture_*`), freed by `close`."""

    def __init__(self, enabled: bool, factory: Callable[..., Callable] = CUDAGraphRunner) -> None:
        self.enabled = enabled  # capture at warm-up; off on the CPU and after a denoise capture fails
        self._factory = factory
        # key -> replay: denoise keys; the encode key (the text encoder, for stepper.encode(embed=));
        # the preview and whole-decode keys of warmed sizes (the VAE on their fixed latent shape)
        self._graphs: dict[tuple, Callable] = {}
        self._runners: list = []  # to free their memory pools (close)

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def __contains__(self, key: tuple) -> bool:
        return key in self._graphs

    def get(self, key: tuple, eager: Callable | None = None) -> Callable | None:
        """The captured replay for an item key, else `eager`."""
        return self._graphs.get(key, eager)

    def embed(self) -> Callable | None:
        """The captured text encoder (for `stepper.encode(..., embed=)`), or None."""
        return self._graphs.get(encode_key())

    def capture_denoise(self, stepper: ImageStepper, key: tuple, jobs: list[ImageJob]) -> None:
        """Capture the denoiser for this bucket during its first warm-up step (eager on failure)."""
        graph = None

        def capture(x, t, emb, pooled):
            nonlocal graph
            inputs = [x, t, emb] + ([] if pooled is None else [pooled])
            graph = self._factory(lambda *a: (stepper.predict(*a[:3], a[3] if len(a) > 3 else None),),
                                  inputs, capture_stream=torch.cuda.Stream() if x.is_cuda else None)
            return graph(*inputs)[0]

        try:
            stepper.denoise(jobs, predict=capture)
        except GraphError as exc:
            log.warning("image denoise steps run eagerly (CUDA graph capture failed: %s)", exc)
            self.enabled = False
            return

        def replay(x, t, emb, pooled):
            # The output is the graph's own buffer: copy it out (schedulers may keep it).
            return graph(*([x, t, emb] + ([] if pooled is None else [pooled])))[0].clone()

        self._graphs[key] = replay
        self._runners.append(graph)

    def capture_text(self, stepper: ImageStepper) -> None:
        """The text encoder(s) on one prompt's tokens (their shapes never change)."""
        tokens = [t.to(stepper.device) for t in stepper.text_tokens("warm up")]
        replay = self._graphed("prompt encodes", stepper.embed_text, tokens)
        if replay is not None:
            self._graphs[encode_key()] = replay

    def capture_vae(self, key: tuple, fn: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor) -> None:
        """A preview or whole decode of one size (its latents' shape is fixed by the size)."""
        replay = self._graphed(f"{key[1]} items of {key[2]}x{key[3]}", lambda x: (fn(x),), [latents])
        if replay is not None:
            self._graphs[key] = lambda x: replay(x)[0]

    def _graphed(self, what: str, fn: Callable[..., tuple], inputs: list[torch.Tensor]) -> Callable | None:
        """`fn` (returning a tuple of tensors) captured as a CUDA graph on its own capture stream,
        for inputs shaped as `inputs`; its replay returns copies of the outputs. None, with a
        warning, when capture fails: `what` then run eagerly."""
        try:
            with torch.no_grad():  # as the eager items run (autograd would also keep activations in the pool)
                graph = self._factory(fn, inputs, capture_stream=torch.cuda.Stream() if inputs[0].is_cuda else None)
        except GraphError as exc:
            log.warning("%s run eagerly (CUDA graph capture failed: %s)", what, exc)
            return None
        self._runners.append(graph)
        return lambda *a: tuple(out.clone() for out in graph(*a))

    def close(self) -> None:
        """Free the captured graphs' memory (steps and encodes run eagerly afterwards)."""
        self._graphs.clear()
        for runner in self._runners:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        self._runners.clear()
