"""The image stepper (models/image_pipeline.py) against diffusers' own `pipe()`, on both tiny
offline pipelines: one request bit for bit, requests batched at different timesteps within
a stated tolerance, and the saved layout loading back through the real loader (its weights bit
for bit, its image within a stated tolerance: the loaded copy's weights sit at other addresses)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import T5Config, T5EncoderModel

from diffusers import SD3Transformer2DModel
from diffusers.models.attention_processor import Attention, FusedAttnProcessor2_0, FusedJointAttnProcessor2_0

from parley.models.image_pipeline import ImagePipelineError, load_image_pipeline, speed_up, stepper_for
from parley.models.tiny_diffusion import tiny_pipeline, tiny_tokenizer, write_tiny_pipeline

BATCH_TOLERANCE = 1e-4  # batched GEMMs reduce in another order than solo ones (fp32: ~1e-6 seen)
# A loaded copy holds the same weights bit for bit, but at other addresses: safetensors leaves them
# unaligned, and a one-row GEMM (CLIP's pooled projection) takes another kernel path on unaligned
# weights on an AVX-512 CPU (fp32: ~1e-6 seen). Same rule as a batch: a stated tolerance.
RELOAD_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["sd", "sd3", "sd+speed_up", "sd3+speed_up"])
def stepper(request):
    """Each family plain, and with `speed_up`'s layout and fusions (on CUDA by default; here on
    the CPU so that every test below also shows the stepper still equals `pipe()` with them)."""
    family, _, fast = request.param.partition("+")
    pipe = tiny_pipeline(family)
    return stepper_for(pipe, speedups=speed_up(pipe) if fast else ())


def reference(stepper, prompt, steps, guidance, seed, size):
    return stepper.pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, height=size, width=size,
                        generator=torch.Generator().manual_seed(seed), output_type="np").images


def run_solo(stepper, prompt, steps, guidance, seed, size):
    job = stepper.start(stepper.encode(prompt, None, stepper.cfg_for(guidance)), size, size, steps, guidance, seed)
    while not job.done:
        stepper.denoise([job])
    return stepper.postprocess(stepper.decode(job.latents))


@pytest.mark.parametrize("guidance", [5.0, 1.0])  # with and without classifier-free guidance
def test_one_request_equals_pipe_bit_for_bit(stepper, guidance):
    size = stepper.default_size
    ours = run_solo(stepper, "a red cat", 4, guidance, 42, size)
    ref = reference(stepper, "a red cat", 4, guidance, 42, size)
    assert ours.shape == (1, size, size, 3)
    assert np.array_equal(ours, ref)


def test_requests_batched_at_different_timesteps_equal_solo_within_tolerance(stepper):
    size = stepper.default_size
    a = stepper.start(stepper.encode("a red cat", None, True), size, size, 4, 5.0, 42)
    b = stepper.start(stepper.encode("a dog", None, True), size, size, 6, 7.0, 7)
    stepper.denoise([b])
    stepper.denoise([b])  # b is two steps ahead: every shared call mixes two timesteps
    assert a.timesteps[a.step] != b.timesteps[b.step]
    while not a.done:
        stepper.denoise([a, b])
    while not b.done:
        stepper.denoise([b])
    for job, args in ((a, ("a red cat", 4, 5.0, 42)), (b, ("a dog", 6, 7.0, 7))):
        ours = stepper.postprocess(stepper.decode(job.latents))
        ref = reference(stepper, *args, size)
        assert np.abs(ours - ref).max() < BATCH_TOLERANCE
    # And the seeds matter: the two images are different.
    assert not np.allclose(stepper.postprocess(stepper.decode(a.latents)),
                           stepper.postprocess(stepper.decode(b.latents)))


def test_a_batch_of_mixed_sizes_or_cfg_is_refused(stepper):
    s = stepper.default_size
    a = stepper.start(stepper.encode("x", None, True), s, s, 2, 5.0, 1)
    b = stepper.start(stepper.encode("x", None, False), s, s, 2, 1.0, 1)
    with pytest.raises(ImagePipelineError, match="one size and CFG"):
        stepper.denoise([a, b])


def test_sizes_off_the_latent_stride_are_refused(stepper):
    cond = stepper.encode("x", None, False)
    with pytest.raises(ImagePipelineError, match="multiple of"):
        stepper.start(cond, stepper.latent_stride * 4 + 1, stepper.latent_stride * 4, 2, 1.0, 0)


def test_to_uint8_rounds_like_pil(stepper):
    s = stepper.default_size
    job = stepper.start(stepper.encode("a", None, False), s, s, 1, 1.0, 3)
    stepper.denoise([job])
    image = stepper.decode(job.latents)
    pil = stepper.pipe.image_processor.postprocess(image, output_type="pil")[0]
    assert np.array_equal(stepper.to_uint8(image)[0], np.asarray(pil))


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_saved_layout_loads_back_and_reproduces_the_image(tmp_path, monkeypatch, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tiny_pipeline(tmp_path / family, family)
    loaded = load_image_pipeline(str(tmp_path / family))
    original = stepper_for(tiny_pipeline(family))
    size = original.default_size
    assert loaded.family == original.family and loaded.latent_stride == original.latent_stride
    for name, module in original.pipe.components.items():  # what the layout stores: bit for bit
        if isinstance(module, torch.nn.Module):
            theirs = getattr(loaded.pipe, name).state_dict()
            assert all(torch.equal(theirs[k], v) for k, v in module.state_dict().items()), name
    ours, ref = run_solo(loaded, "a cat", 2, 4.0, 5, size), run_solo(original, "a cat", 2, 4.0, 5, size)
    assert np.abs(ours - ref).max() < RELOAD_TOLERANCE  # the image: within a reload's tolerance


def test_loading_something_else_says_what_is_supported(tmp_path):
    with pytest.raises(ImagePipelineError, match="cannot read a diffusers pipeline"):
        load_image_pipeline(str(tmp_path / "missing"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ImagePipelineError, match="supported pipelines: StableDiffusionPipeline"):
        load_image_pipeline(str(tmp_path / "other"))


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_negative_prompts_are_encoded_once_and_images_still_equal_pipe(family):
    """CFG needs the negative prompt's embeddings (of "" when none): encoded once, then reused,
    so a request costs one text-encoder pass; the image is still pipe()'s bit for bit."""
    st = stepper_for(tiny_pipeline(family))
    size = st.default_size
    calls = []
    hook = st.pipe.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        passes = []
        for prompt, negative in (("a red cat", "blurry"), ("a dog", "blurry"), ("a dog", None), ("a cat", None)):
            before = len(calls)
            units = st.encode_units(negative, True)
            cond = st.encode(prompt, negative, True)
            assert units == len(calls) - before  # the queue's cost estimate scales with it
            passes.append(len(calls) - before)
            job = st.start(cond, size, size, 3, 5.0, 3)
            while not job.done:
                st.denoise([job])
            ours = st.postprocess(st.decode(job.latents))
            ref = st.pipe(prompt, negative_prompt=negative, num_inference_steps=3, guidance_scale=5.0, height=size,
                          width=size, generator=torch.Generator().manual_seed(3), output_type="np").images
            assert np.array_equal(ours, ref), (prompt, negative)
    finally:
        hook.remove()
    assert passes == [2, 1, 2, 1]  # a new negative costs one more pass, a known one none


@torch.no_grad()  # as pipe() runs it (T5 under autograd takes other kernels: ~1e-6 off)
def encode_prompt_rows(st, prompt, negative):
    """pipe.encode_prompt's conditioning as Conditioning rows: [negative, positive] (+ pooled)."""
    if st.family == "unet":
        pe, npe = st.pipe.encode_prompt(prompt, st.device, 1, True, negative_prompt=negative)
        return torch.cat([npe, pe]), None
    pe, npe, pooled, npooled = st.pipe.encode_prompt(prompt, None, None, device=st.device,
                                                      do_classifier_free_guidance=True, negative_prompt=negative)
    return torch.cat([npe, pe]), torch.cat([npooled, pooled])


def tiny_sd3_with_t5():
    """The tiny SD3 with a tiny T5 encoder (its tokenizer: the tiny CLIP one; any tokenizer
    pads the same way), so the T5 path runs too."""
    pipe = tiny_pipeline("sd3")
    t5 = T5EncoderModel(T5Config(vocab_size=len(pipe.tokenizer), d_model=64, d_kv=8, d_ff=64, num_layers=1,
                                 num_heads=2)).eval()
    pipe.register_modules(text_encoder_3=t5, tokenizer_3=tiny_tokenizer())
    return pipe


@pytest.mark.parametrize("family", ["sd", "sd3", "sd3+t5"])
def test_encode_equals_encode_prompt_bit_for_bit_and_embed_replaces_the_text_encoders(family):
    """Each family's encode (host tokenizers, then `embed_text` on fixed token shapes) gives
    pipe.encode_prompt's conditioning bit for bit; `embed=` (the queue's CUDA graph) is what runs."""
    st = stepper_for(tiny_sd3_with_t5() if family == "sd3+t5" else tiny_pipeline(family))
    shapes = [tuple(t.shape) for t in st.text_tokens("a red cat")]
    assert shapes == [tuple(t.shape) for t in st.text_tokens("a much longer prompt " * 40)]  # graphable
    assert len(shapes) == {"sd": 1, "sd3": 2, "sd3+t5": 3}[family]
    calls = []

    def embed(*tokens):
        calls.append([tuple(t.shape) for t in tokens])
        return st.embed_text(*tokens)

    for prompt, negative in (("a red cat", None), ("a dog", "blurry"), ("a long prompt " * 40, None)):
        embeds, pooled = encode_prompt_rows(st, prompt, negative)
        fresh = stepper_for(st.pipe)  # an empty negative cache: both passes run through `embed`
        calls.clear()
        cond = fresh.encode(prompt, negative, True, embed=embed)
        assert torch.equal(cond.embeds, embeds), (prompt, negative)
        assert (cond.pooled is None and pooled is None) or torch.equal(cond.pooled, pooled)
        assert calls == [shapes] * 2
        alone = st.encode(prompt, negative, False)
        assert torch.equal(alone.embeds, embeds[1:]) and (pooled is None or torch.equal(alone.pooled, pooled[1:]))


def conv_weights(module):
    return [p for p in module.parameters() if p.dim() == 4]


def processors(module):
    return {type(p) for p in module.attn_processors.values()}


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_load_applies_channels_last_and_fused_qkv_when_asked_and_not_on_cpu_by_default(tmp_path, monkeypatch, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tiny_pipeline(tmp_path / family, family)
    fast = load_image_pipeline(str(tmp_path / family), channels_last=True, fused_qkv=True)
    plain = load_image_pipeline(str(tmp_path / family))  # CPU: None means off
    assert plain.speedups == ()
    denoiser = "unet" if family == "sd" else "transformer"
    expected = {"sd": ("unet channels_last", "vae channels_last", "unet fused qkv", "vae fused qkv"),
                "sd3": ("vae channels_last", "transformer fused qkv", "vae fused qkv")}[family]
    assert fast.speedups == expected
    for name in ("unet", "vae") if family == "sd" else ("vae",):
        fast_convs, plain_convs = conv_weights(getattr(fast.pipe, name)), conv_weights(getattr(plain.pipe, name))
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in fast_convs), name
        assert any(not w.is_contiguous() for w in fast_convs), name  # (1x1 kernels are both layouts)
        assert all(w.is_contiguous() for w in plain_convs), name
    fused = {"sd": FusedAttnProcessor2_0, "sd3": FusedJointAttnProcessor2_0}[family]
    assert processors(getattr(fast.pipe, denoiser)) == {fused}
    assert processors(fast.pipe.vae) == {FusedAttnProcessor2_0}
    assert fused not in processors(getattr(plain.pipe, denoiser))
    assert FusedAttnProcessor2_0 not in processors(plain.pipe.vae)
    for module in (getattr(fast.pipe, denoiser), fast.pipe.vae):
        attentions = [m for m in module.modules() if isinstance(m, Attention)]
        assert attentions and all(hasattr(m, "to_kv" if m.is_cross_attention else "to_qkv") for m in attentions)
    # The same arithmetic up to the GEMMs' summation order.
    size = plain.default_size
    assert np.abs(run_solo(fast, "a cat", 2, 4.0, 5, size) - run_solo(plain, "a cat", 2, 4.0, 5, size)).max() < 1e-4


def test_an_sd3_transformer_with_query_key_norms_stays_unfused():
    """diffusers' fused joint processor skips SD 3.5's query/key norms: fusing would change the
    model, so only the VAE fuses."""
    pipe = tiny_pipeline("sd3")
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    pipe.register_modules(transformer=SD3Transformer2DModel(**{**config, "qk_norm": "rms_norm"}))
    assert all(a.norm_q is not None for a in pipe.transformer.modules() if isinstance(a, Attention))
    before = processors(pipe.transformer)
    applied = speed_up(pipe)
    assert "transformer fused qkv" not in applied and "vae fused qkv" in applied
    assert processors(pipe.transformer) == before != {FusedJointAttnProcessor2_0}
