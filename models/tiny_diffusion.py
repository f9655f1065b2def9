"""Tiny random text-to-image pipelines, built offline (no hub access), for tests and the demo.

Both families of `image_pipeline.py`: a Stable-Diffusion-1.5-shaped pipeline (UNet, CLIP,
VAE, DDIM) and a Stable-Diffusion-3-shaped one (MMDiT, two CLIP encoders, no T5,
flow-matching Euler). Weights are random (seeded), so images are noise; every code path
(encode, CFG, batched steps, decode, save/load) is the real one.

The CLIP tokenizer is built from a vocabulary written here (letters and end-of-word
letters, no merges). Pass `vocab=`/`merges=` explicitly: transformers 5.x silently ignores
the older `vocab_file=`/`merges_file=` keywords and builds a 3-token vocabulary.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from diffusers import (AutoencoderKL, DDIMScheduler, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                       StableDiffusion3Pipeline, StableDiffusionPipeline, UNet2DConditionModel)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

MAX_TOKENS = 16  # the tokenizer's model_max_length: prompts pad/truncate to it
FAMILIES = ("sd", "sd3")


def tiny_tokenizer(model_max_length: int = MAX_TOKENS) -> CLIPTokenizer:
    symbols = list(string.ascii_lowercase + string.digits)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for s in symbols + [f"{s}</w>" for s in symbols]:
        vocab[s] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def _clip_config(vocab_size: int, **extra) -> CLIPTextConfig:
    return CLIPTextConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=vocab_size, max_position_embeddings=MAX_TOKENS, bos_token_id=0,
                          eos_token_id=1, pad_token_id=1, **extra)


def tiny_sd(seed: int = 0) -> StableDiffusionPipeline:
    """SD-1.5-shaped: latent stride 2 (a two-block VAE), default size 16 px."""
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, cross_attention_dim=32, norm_num_groups=8,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
    vae = AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2)
    text_encoder = CLIPTextModel(_clip_config(len(tokenizer)))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   image_encoder=None, requires_safety_checker=False)


def tiny_sd3(seed: int = 0) -> StableDiffusion3Pipeline:
    """SD3-shaped without T5: latent stride 4 (two-block VAE x patch 2), default size 32 px."""
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                        joint_attention_dim=64, pooled_projection_dim=64)
    vae = AutoencoderKL(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    enc1 = CLIPTextModelWithProjection(_clip_config(len(tokenizer), projection_dim=32))
    enc2 = CLIPTextModelWithProjection(_clip_config(len(tokenizer), projection_dim=32))
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=enc1.eval(), tokenizer=tokenizer,
                                    text_encoder_2=enc2.eval(), tokenizer_2=tiny_tokenizer(),
                                    text_encoder_3=None, tokenizer_3=None)


def sd15_shaped(seed: int = 0) -> StableDiffusionPipeline:
    """Stable Diffusion 1.5's shapes (859 M-parameter UNet, its VAE and CLIP-L text encoder)
    with random weights and the letters tokenizer: compute and memory traffic of the real
    model, for benchmarks. Build on the CPU, then move it (`.to("cuda", torch.bfloat16)`)."""
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(77)
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4,
                        sample_size=512)
    text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                num_attention_heads=12, max_position_embeddings=77,
                                                vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1,
                                                pad_token_id=1))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   image_encoder=None, requires_safety_checker=False)


def tiny_pipeline(family: str, seed: int = 0):
    if family == "sd":
        return tiny_sd(seed)
    if family == "sd3":
        return tiny_sd3(seed)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")


def write_tiny_pipeline(directory: Path, family: str = "sd", seed: int = 0) -> Path:
    """Save a tiny pipeline in the published diffusers layout (model_index.json, unet/, vae/, ...)."""
    tiny_pipeline(family, seed).save_pretrained(directory)
    return directory
