"""Text-to-image pipelines driven one step at a time (model code only: no engine imports).

A `diffusers` pipeline's `__call__` runs encode, every denoise step and the decode in one
go, keeps per-call state on the pipeline and cannot batch two requests at different steps.
The engine needs each of those as a separate, bounded piece of work, so this module drives
the pipeline's *components* itself, in the same order and with the same arithmetic as
`pipe()` (a single request's image equals `pipe()`'s bit for bit; tests check it):

    cond  = stepper.encode(prompt, negative, cfg)          # tokenizer (host), text encoders
    job   = stepper.start(cond, width, height, steps, guidance, seed)
    while not job.done: stepper.denoise([job, other, ...])  # one step each, batched
    image = stepper.to_uint8(stepper.decode(job.latents))   # VAE, then 0..255 HWC

Latents larger than one VAE tile decode in tiles, one call per tile, so no single call grows
with the image (`stepper.tiled_decode(latents)`: diffusers' `AutoencoderKL.tiled_decode`,
split); `stepper.preview(latents)` is a cheap look at unfinished latents (decoded at reduced
resolution, then upsampled).

Each job owns a deep copy of the pipeline's scheduler (schedulers are stateful: step index,
multistep history; `from_config` would also lose the patched `steps_offset`) and a CPU
generator (device-independent noise). A batched `denoise` concatenates jobs at *different*
timesteps with a per-sample timestep vector; each job then takes its own scheduler step.
Batched results differ from solo ones only by GEMM reduction order (float rounding).

Two families: `UNetStepper` (Stable Diffusion 1.x/2.x: UNet, CLIP, VAE, CFG) and
`FlowStepper` (Stable Diffusion 3: MMDiT transformer, flow-matching Euler; the T5 encoder
may be absent). Other pipelines (SDXL, FLUX, ...) are refused at load with a clear error.

On CUDA the loader applies diffusers' own inference advice to the components in place
(`speed_up`: fused attention projections; channels_last convolutions only when asked), so
`pipe()` and the stepper run the same modules; `benchmarks/image_step.py` measures each choice.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from transformers.utils import logging as hf_logging

# diffusers imports transformers' image processors (for safety checkers we do not load); without
# torchvision each one warns about a fallback we never use. Keep the server log for real news.
hf_logging.get_logger("transformers.utils.import_utils").setLevel(hf_logging.ERROR)

from diffusers import (DiffusionPipeline, SD3Transformer2DModel, StableDiffusion3Pipeline,  # noqa: E402
                       StableDiffusionPipeline)
from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift  # noqa: E402

from .host_rows import to_device  # noqa: E402


# A job's timesteps stay on the host: a scheduler's step reads its timestep on the host (DDIM indexes
# its host table with it), which with a device timestep is a sync; the denoiser gets them as one copy.
# Its first latents are drawn here too (the CPU generator), then sent without a sync.
HOST = torch.device("cpu")

# (latents, per-row timesteps, text embeddings, pooled embeddings or None) -> noise prediction
Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# `text_tokens`' tensors, on the device -> (text embeddings[, pooled embeddings]): `embed_text`
TextEmbed = Callable[..., "tuple[torch.Tensor, ...]"]


class ImagePipelineError(ValueError):
    """A pipeline this module cannot drive, or a request it cannot serve; the message says why."""


@dataclass
class Conditioning:
    """One prompt's text conditioning, CFG rows first: [negative, positive] or [positive]."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None  # SD3's pooled CLIP projections, same row layout


@dataclass
class ImageJob:
    """One image being denoised: its own scheduler, generator and latents."""

    cond: Conditioning
    scheduler: object
    generator: torch.Generator
    latents: torch.Tensor
    timesteps: torch.Tensor
    guidance: float
    width: int
    height: int
    step: int = 0
    step_kwargs: dict = field(default_factory=dict)

    @property
    def cfg(self) -> bool:
        return self.cond.embeds.shape[0] == 2

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)


class ImageStepper:
    """What both families share: prompt validation, latents, decode and post-processing."""

    family = ""
    NEGATIVES_CACHED = 16  # negative prompts whose embeddings are kept (most requests send none)

    def __init__(self, pipe: DiffusionPipeline, name: str = "", speedups: tuple[str, ...] = ()) -> None:
        self.pipe = pipe
        self.name = name or type(pipe).__name__
        self.speedups = speedups  # what `speed_up` applied to the components (for the log)
        pipe.set_progress_bar_config(disable=True)
        self._negatives: dict[str, tuple[torch.Tensor, ...]] = {}  # negative prompt -> embeddings, oldest first

    # ---- facts the API validates against ----

    @property
    def device(self) -> torch.device:
        return self.pipe._execution_device

    @property
    def dtype(self) -> torch.dtype:
        return self.denoiser.dtype

    @property
    def latent_stride(self) -> int:
        """Pixels per latent cell (times the transformer's patch size): sizes must be multiples."""
        return self.pipe.vae_scale_factor * self.patch_size

    patch_size = 1

    @property
    def default_size(self) -> int:
        return self.denoiser.config.sample_size * self.pipe.vae_scale_factor

    @property
    def denoiser(self) -> torch.nn.Module:
        raise NotImplementedError

    def cfg_for(self, guidance: float) -> bool:
        """Whether `pipe()` would run classifier-free guidance at this guidance scale."""
        return guidance > 1.0

    # ---- text: the host tokenizes, the device embeds (one fixed shape: a CUDA graph can replay it) ----

    @torch.no_grad()
    def encode(self, prompt: str, negative: str | None, cfg: bool, embed: TextEmbed | None = None) -> Conditioning:
        """pipe.encode_prompt's conditioning, bit for bit (tests check it). `embed` replaces
        `embed_text` (e.g. by a CUDA graph of it). With CFG the negative ("" when none) is
        encoded once, then reused: one text-encoder pass per request."""
        positive = self._text(prompt, embed)
        if not cfg:
            return Conditioning(*positive)
        negative_rows = self._negative(negative or "", embed)
        return Conditioning(*(torch.cat([n, p]) for n, p in zip(negative_rows, positive)))

    def encode_units(self, negative: str | None, cfg: bool) -> int:
        """The work `encode` will do, in units of a warmed encode (for cost estimates)."""
        return 2 if cfg and (negative or "") not in self._negatives else 1  # + the negative's pass

    def text_tokens(self, text: str) -> tuple[torch.Tensor, ...]:
        """One prompt's token tensors on the host, of one shape whatever the prompt (tokenizers
        pad to their maximum length), as pipe.encode_prompt tokenizes them; not its second,
        untruncated tokenization, which only feeds a warning that a long prompt was cut."""
        raise NotImplementedError

    def embed_text(self, *tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All the device work of one prompt's encode, on `text_tokens`' tensors moved to the device."""
        raise NotImplementedError

    def _text(self, text: str, embed: TextEmbed | None) -> tuple[torch.Tensor, ...]:
        tokens = [to_device(t, self.device) for t in self.text_tokens(text)]
        return tuple((embed or self.embed_text)(*tokens))

    def _negative(self, text: str, embed: TextEmbed | None) -> tuple[torch.Tensor, ...]:
        cache = self._negatives
        rows = cache.pop(text, None)
        if rows is None:
            rows = self._text(text, embed)
        cache[text] = rows  # most recent last
        while len(cache) > self.NEGATIVES_CACHED:
            del cache[next(iter(cache))]
        return rows

    # ---- the steps ----

    @torch.no_grad()
    def start(self, cond: Conditioning, width: int, height: int, steps: int, guidance: float,
              seed: int | None) -> ImageJob:
        if width % self.latent_stride or height % self.latent_stride:
            raise ImagePipelineError(f"size {width}x{height} is not a multiple of {self.latent_stride}.")
        generator = torch.Generator("cpu").manual_seed(random.getrandbits(63) if seed is None else seed)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        latents = to_device(self.pipe.prepare_latents(1, self.denoiser.config.in_channels, height, width,
                                                      cond.embeds.dtype, HOST, generator, None), self.device)
        self._set_timesteps(scheduler, steps, latents)
        accepts = set(inspect.signature(scheduler.step).parameters)
        step_kwargs = {"generator": generator} if "generator" in accepts else {}
        if "eta" in accepts:
            step_kwargs["eta"] = 0.0
        return ImageJob(cond, scheduler, generator, latents, scheduler.timesteps, guidance, width, height,
                        step_kwargs=step_kwargs)

    def _set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> None:
        scheduler.set_timesteps(steps, device=HOST)

    @torch.no_grad()
    def denoise(self, jobs: list[ImageJob], predict: Predict | None = None) -> None:
        """One step for each job (same size and CFG setting; timesteps may differ). `predict`
        replaces the denoiser call (`self.predict`'s signature), e.g. by a CUDA graph of it."""
        if not jobs:
            return
        cfg = jobs[0].cfg
        if any(j.cfg != cfg or j.latents.shape != jobs[0].latents.shape or j.done for j in jobs):
            raise ImagePipelineError("a denoise batch needs unfinished jobs of one size and CFG setting.")
        rows = 2 if cfg else 1
        ts = [j.timesteps[j.step] for j in jobs]
        x = torch.cat([self._model_input(j, torch.cat([j.latents] * rows), t) for j, t in zip(jobs, ts)])
        t_vec = to_device(torch.cat([t.expand(rows) for t in ts]), self.device)
        emb = torch.cat([j.cond.embeds for j in jobs])
        pooled = torch.cat([j.cond.pooled for j in jobs]) if jobs[0].cond.pooled is not None else None
        pred = (predict or self.predict)(x, t_vec, emb, pooled)
        for i, (job, t) in enumerate(zip(jobs, ts)):
            noise = pred[i * rows:(i + 1) * rows]
            if cfg:
                uncond, text = noise.chunk(2)
                noise = uncond + job.guidance * (text - uncond)
            job.latents = job.scheduler.step(noise, t, job.latents, **job.step_kwargs, return_dict=False)[0]
            job.step += 1

    def _model_input(self, job: ImageJob, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x

    def predict(self, x: torch.Tensor, t: torch.Tensor, emb: torch.Tensor,
                pooled: torch.Tensor | None) -> torch.Tensor:
        """The denoiser on a batch: latents, per-row timesteps, text embeddings (+ pooled)."""
        raise NotImplementedError

    # ---- VAE: whole, in tiles, or a cheap preview ----

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the VAE decoder takes them (unscaled, unshifted)."""
        return latents / self.pipe.vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE decode to an image tensor in the VAE's range (about -1..1), NCHW."""
        return self.pipe.vae.decode(self.vae_input(latents), return_dict=False)[0]

    @property
    def vae_tile(self) -> int:
        """Latent cells per side of one VAE tile (diffusers' `tile_latent_min_size`)."""
        return self.pipe.vae.tile_latent_min_size

    def tiled(self, width: int, height: int) -> bool:
        """Whether images of this size decode in tiles (their latents exceed one tile)."""
        return max(width, height) // self.pipe.vae_scale_factor > self.vae_tile

    def tiled_decode(self, latents: torch.Tensor) -> "TiledDecode":
        return TiledDecode(self.pipe.vae, self.vae_input(latents))

    @torch.no_grad()
    def preview(self, latents: torch.Tensor) -> torch.Tensor:
        """A cheap image of unfinished latents, NCHW at full size: the latents are area-averaged
        to at most half their side (and at most one VAE tile), decoded, and upsampled, so a
        preview costs at most a quarter of a full decode and never more than one tile."""
        h, w = latents.shape[-2:]
        shrink = max(2, math.ceil(max(h, w) / self.vae_tile))
        small = F.interpolate(latents, size=(max(1, h // shrink), max(1, w // shrink)), mode="area")
        image = self.pipe.vae.decode(self.vae_input(small), return_dict=False)[0]
        scale = self.pipe.vae_scale_factor
        return F.interpolate(image, size=(h * scale, w * scale), mode="bilinear", align_corners=False)

    def postprocess(self, image: torch.Tensor) -> np.ndarray:
        """As `pipe(output_type="np")`: float32 NHWC in 0..1."""
        return self.pipe.image_processor.postprocess(image, output_type="np")

    def to_uint8(self, image: torch.Tensor) -> np.ndarray:
        """NHWC uint8 on the host, rounded like `pipe(output_type="pil")`."""
        return self.uint8_pixels(image).cpu().numpy()

    def uint8_pixels(self, image: torch.Tensor) -> torch.Tensor:
        """`to_uint8`'s pixels, still on the image's device: the rounding runs there (the same float32
        arithmetic), so only uint8 pixels cross to the host, and the caller chooses when."""
        pixels = self.pipe.image_processor.postprocess(image, output_type="pt")
        return (pixels.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


class TiledDecode:
    """A VAE decode in overlapping tiles, one `step()` per tile, then `image()` blends them:
    the tiles and arithmetic of diffusers' `AutoencoderKL.tiled_decode`, split so that each
    tile can run as its own bounded piece of work (the blend is vectorised: one op per seam
    instead of one per pixel row)."""

    def __init__(self, vae, z: torch.Tensor) -> None:
        self.vae, self.z = vae, z
        size = vae.tile_latent_min_size
        stride = int(size * (1 - vae.tile_overlap_factor))
        self.rows = len(range(0, z.shape[2], stride))
        self.cols = len(range(0, z.shape[3], stride))
        self.origins = [(i, j) for i in range(0, z.shape[2], stride) for j in range(0, z.shape[3], stride)]
        self.decoded: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return len(self.decoded) == len(self.origins)

    @torch.no_grad()
    def step(self) -> None:
        """Decode the next tile."""
        i, j = self.origins[len(self.decoded)]
        size = self.vae.tile_latent_min_size
        tile = self.z[:, :, i:i + size, j:j + size]
        if self.vae.config.use_post_quant_conv:
            tile = self.vae.post_quant_conv(tile)
        self.decoded.append(self.vae.decoder(tile))

    @torch.no_grad()
    def image(self) -> torch.Tensor:
        """The blended image (after every tile is decoded)."""
        if not self.done:
            raise RuntimeError("TiledDecode.image() before every tile was decoded.")
        blend = int(self.vae.tile_sample_min_size * self.vae.tile_overlap_factor)
        limit = self.vae.tile_sample_min_size - blend
        tiles = [t.clone() for t in self.decoded]  # the blend writes in place: image() stays repeatable
        rows = [tiles[r * self.cols:(r + 1) * self.cols] for r in range(self.rows)]
        out_rows = []
        for i, row in enumerate(rows):
            out = []
            for j, tile in enumerate(row):
                if i > 0:
                    _blend(rows[i - 1][j], tile, blend, dim=2)
                if j > 0:
                    _blend(row[j - 1], tile, blend, dim=3)
                out.append(tile[:, :, :limit, :limit])
            out_rows.append(torch.cat(out, dim=3))
        return torch.cat(out_rows, dim=2)


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> None:
    """`b`'s first `extent` rows (dim 2) or columns (dim 3) fade in from `a`'s last ones, in
    place: diffusers' blend_v / blend_h with the per-row Python scalars as one float32 ramp
    (each product rounded to the tensor's dtype, then summed, as the scalar ops round)."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent == 0:
        return
    ramp = torch.tensor([y / extent for y in range(extent)], dtype=torch.float64)
    shape = [1, 1, 1, 1]
    shape[dim] = extent
    w_b = ramp.to(torch.float32).reshape(shape).to(b.device)
    w_a = (1 - ramp).to(torch.float32).reshape(shape).to(b.device)
    head = b.narrow(dim, 0, extent)
    faded = (a.narrow(dim, a.shape[dim] - extent, extent).float() * w_a).to(b.dtype)
    kept = (head.float() * w_b).to(b.dtype)
    head.copy_((faded.float() + kept.float()).to(b.dtype))


class UNetStepper(ImageStepper):
    """Stable Diffusion 1.x / 2.x: CLIP text encoder, UNet with epsilon/v prediction, VAE."""

    family = "unet"

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet

    def cfg_for(self, guidance: float) -> bool:
        return guidance > 1.0 and self.pipe.unet.config.time_cond_proj_dim is None

    def text_tokens(self, text):
        tokenizer = self.pipe.tokenizer
        inputs = tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                           return_tensors="pt")
        if getattr(self.pipe.text_encoder.config, "use_attention_mask", False):
            return inputs.input_ids, inputs.attention_mask
        return (inputs.input_ids,)

    def embed_text(self, ids, mask=None):
        encoder = self.pipe.text_encoder
        return (encoder(ids, attention_mask=mask)[0].to(dtype=encoder.dtype),)

    def _model_input(self, job: ImageJob, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return job.scheduler.scale_model_input(x, t)

    def predict(self, x, t, emb, pooled=None):
        return self.pipe.unet(x, t, encoder_hidden_states=emb, return_dict=False)[0]


class FlowStepper(ImageStepper):
    """Stable Diffusion 3: two CLIP encoders (+ optional T5), MMDiT, flow-matching Euler."""

    family = "flow"

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def patch_size(self) -> int:
        return self.pipe.transformer.config.patch_size

    T5_TOKENS = 256  # pipe.encode_prompt's max_sequence_length (the T5 rows, zeros without T5)

    def text_tokens(self, text):
        p = self.pipe
        tokens = (self._tokens(p.tokenizer, text, p.tokenizer_max_length),
                  self._tokens(p.tokenizer_2, text, p.tokenizer_max_length))
        return tokens if p.text_encoder_3 is None else tokens + (self._tokens(p.tokenizer_3, text, self.T5_TOKENS),)

    def embed_text(self, ids, ids_2, ids_3=None):
        # pipe.encode_prompt's arithmetic: both CLIPs' penultimate hidden states side by side,
        # zero-padded to T5's width, above the T5 rows (zeros without T5); pooled: both projections.
        p = self.pipe
        embeds, pooled = self._clip(p.text_encoder, ids)
        embeds_2, pooled_2 = self._clip(p.text_encoder_2, ids_2)
        clip = torch.cat([embeds, embeds_2], dim=-1)
        if ids_3 is None:
            t5 = torch.zeros((1, self.T5_TOKENS, p.transformer.config.joint_attention_dim), device=ids.device,
                             dtype=p.text_encoder.dtype)
        else:
            t5 = p.text_encoder_3(ids_3)[0].to(dtype=p.text_encoder_3.dtype)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled, pooled_2], dim=-1)

    @staticmethod
    def _tokens(tokenizer, text: str, max_length: int) -> torch.Tensor:
        return tokenizer(text, padding="max_length", max_length=max_length, truncation=True,
                         return_tensors="pt").input_ids

    def _clip(self, encoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2].to(dtype=self.pipe.text_encoder.dtype), out[0]

    def _set_timesteps(self, scheduler, steps, latents):
        config = scheduler.config
        if not config.get("use_dynamic_shifting", None):
            scheduler.set_timesteps(steps, device=HOST)
            return
        _, _, h, w = latents.shape
        p = self.patch_size
        mu = calculate_shift((h // p) * (w // p), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.16))
        scheduler.set_timesteps(steps, device=HOST, mu=mu)

    def predict(self, x, t, emb, pooled):
        return self.pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=emb,
                                     pooled_projections=pooled, return_dict=False)[0]

    def vae_input(self, latents):
        vae = self.pipe.vae
        return latents / vae.config.scaling_factor + vae.config.shift_factor


STEPPERS: dict[str, tuple[type[DiffusionPipeline], type[ImageStepper], dict]] = {
    # model_index.json _class_name -> (pipeline class, stepper, loading kwargs)
    "StableDiffusionPipeline": (StableDiffusionPipeline, UNetStepper,
                                {"safety_checker": None, "feature_extractor": None,
                                 "requires_safety_checker": False}),
    "StableDiffusion3Pipeline": (StableDiffusion3Pipeline, FlowStepper, {}),
}


def stepper_for(pipe: DiffusionPipeline, name: str = "", speedups: tuple[str, ...] = ()) -> ImageStepper:
    """Wrap an already-built pipeline (tests and the demo build them in memory)."""
    entry = STEPPERS.get(type(pipe).__name__)
    if entry is None:
        raise ImagePipelineError(f"{type(pipe).__name__} is not supported; supported: {', '.join(STEPPERS)}.")
    return entry[1](pipe, name, speedups)


# What the loader applies on CUDA unless told, as benchmarks/image_step.py measures them: fused QKV
# makes the denoise step faster; channels_last makes both the step and the VAE decode slower
# (PyTorch's CUDA GroupNorm works in NCHW: a layout copy around each one).
CUDA_SPEEDUPS = {"channels_last": False, "fused_qkv": True}


def speed_up(pipe: DiffusionPipeline, *, channels_last: bool = True, fused_qkv: bool = True) -> tuple[str, ...]:
    """diffusers' inference advice, applied in place to the pipeline's components (so `pipe()`
    and a stepper run the same modules); returns what was applied, e.g. "unet channels_last".

    channels_last: the conv-heavy UNet and VAE get NHWC weights (cuDNN's tensor-core convolutions
    are NHWC; a convolution's output follows its weight's layout, so inputs need no conversion and
    a CUDA graph captures the NHWC kernels). fused_qkv: one GEMM for an attention's Q, K and V
    (K and V for cross-attention) instead of three; the unfused weights stay (diffusers keeps them
    to undo the fusion), so the attention projections take their memory twice."""
    applied = []
    if channels_last:
        for name in ("unet", "vae"):  # SD3's MMDiT is all GEMMs but its patch embedding: nothing to gain
            module = getattr(pipe, name, None)
            if module is not None:
                module.to(memory_format=torch.channels_last)
                applied.append(f"{name} channels_last")
    if fused_qkv:
        for name in ("unet", "transformer", "vae"):
            module = getattr(pipe, name, None)
            if module is not None and hasattr(module, "fuse_qkv_projections") and _fusable(module):
                module.fuse_qkv_projections()
                applied.append(f"{name} fused qkv")
    return tuple(applied)


def default_speed_up(pipe: DiffusionPipeline, device: str | torch.device, *, channels_last: bool | None = None,
                     fused_qkv: bool | None = None) -> tuple[str, ...]:
    """`speed_up` as the loader applies it: an option left None is CUDA_SPEEDUPS' on CUDA, off elsewhere."""
    auto = CUDA_SPEEDUPS if torch.device(device).type == "cuda" else {"channels_last": False, "fused_qkv": False}
    return speed_up(pipe, channels_last=auto["channels_last"] if channels_last is None else channels_last,
                    fused_qkv=auto["fused_qkv"] if fused_qkv is None else fused_qkv)


def _fusable(module: torch.nn.Module) -> bool:
    """Whether diffusers' fused processors compute what the model's own ones do. The joint
    (SD3) one drops query/key norms (SD 3.5) and needs a text stream in every attention (SD 3.5's
    extra image-only attention has none): such a transformer stays unfused."""
    if not isinstance(module, SD3Transformer2DModel):  # UNet, VAE: plain self/cross attention
        return True
    return all(getattr(a, "add_q_proj", None) is not None
               and all(getattr(a, n, None) is None for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"))
               for a in module.modules() if isinstance(a, Attention))


def load_image_pipeline(source: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        *, channels_last: bool | None = None, fused_qkv: bool | None = None) -> ImageStepper:
    """Load a diffusers pipeline from a local directory or a Hugging Face id and wrap it.
    `channels_last` / `fused_qkv` (`speed_up`): None means CUDA_SPEEDUPS on CUDA, off elsewhere."""
    try:
        index = DiffusionPipeline.load_config(source)
    except Exception as exc:  # missing dir, no model_index.json, hub unreachable, ...
        raise ImagePipelineError(f"cannot read a diffusers pipeline from {source!r}: {exc}") from exc
    class_name = index.get("_class_name", "")
    entry = STEPPERS.get(class_name)
    if entry is None:
        raise ImagePipelineError(f"{source} is a {class_name or 'unknown pipeline'}; supported pipelines: "
                                 f"{', '.join(STEPPERS)}.")
    pipe_cls, stepper_cls, kwargs = entry
    # Components saved as absent (e.g. SD3 without T5: `text_encoder_3: [null, null]`) must be
    # passed as None, or from_pretrained refuses the pipeline as incomplete.
    absent = {k: None for k, v in index.items() if not k.startswith("_") and isinstance(v, (list, tuple))
              and all(x is None for x in v)}
    pipe = pipe_cls.from_pretrained(source, dtype=dtype, **{**absent, **kwargs}).to(device)
    speedups = default_speed_up(pipe, device, channels_last=channels_last, fused_qkv=fused_qkv)
    return stepper_cls(pipe, str(source).rstrip("/").split("/")[-1], speedups)
