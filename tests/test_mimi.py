"""Mimi codec: fidelity to the reference, per-row state isolation, CUDA.

The reference is the published `moshi` package, version 0.2.13 (a test-only oracle; Parley's
runtime never imports it). Its streaming mode (`with ref.streaming(B): ref.encode(frame)` per
1920-sample frame) is what `Mimi.encode_step` / `decode_step` must reproduce.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from parley.models import kernels
from parley.models.config import FRAME_SAMPLES, MimiConfig, tiny_mimi_config
from parley.models.mimi import Mimi, MimiState, model_key
from parley.models.mimi.quantizer import Codebook
from parley.models.synthetic import fit_codebooks_, randomize_mimi_state_

FRAMES = 60  # >= 50 frames (4.8 s): the tiny transformer's 20-step context ring wraps 6 times


# ----------------------------------------------------------------------------- helpers

def reference_config(cfg: MimiConfig) -> dict:
    """Our frozen MimiConfig in the reference's mimi config dict layout (tuples -> lists)."""
    def lists(value):
        if isinstance(value, dict):
            return {k: lists(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return [lists(v) for v in value]
        return value

    raw = lists(dataclasses.asdict(cfg))
    raw.pop("num_codebooks")
    return raw


def published_key(reference_key: str) -> str:
    """A reference in-memory state_dict key -> the published file's name of the same tensor."""
    return (reference_key.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
            .replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight"))


def reference_key(key: str) -> str:
    """The published name of an attention projection -> the reference model's in-memory name."""
    return (key.replace("self_attn.in_proj_weight", "self_attn.in_projs.0.weight")
            .replace("self_attn.out_proj.weight", "self_attn.out_projs.0.weight"))


def random_mimi(cfg: MimiConfig, seed: int = 0) -> Mimi:
    mimi = Mimi(cfg)
    state = mimi.state_dict()
    randomize_mimi_state_(state, seed)
    mimi.load_state_dict(state, strict=True)
    return mimi


def chirp_and_noise(batch: int, frames: int, seed: int) -> torch.Tensor:
    """[batch, frames * 1920]: a 100 Hz -> 4 kHz chirp plus noise, a different phase per row."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME_SAMPLES, dtype=torch.float32) / 24_000
    phase = torch.rand(batch, 1, generator=generator) * 2 * math.pi
    sweep = 100 + (4_000 - 100) * t / t[-1] / 2
    chirp = 0.5 * torch.sin(2 * math.pi * sweep * t + phase)
    return chirp + 0.05 * torch.randn(batch, t.numel(), generator=generator)


def random_codes(batch: int, frames: int, cfg: MimiConfig, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.quantizer.bins, (batch, cfg.num_codebooks, frames), generator=generator)


def run_stream(mimi: Mimi, pcm: torch.Tensor, codes: torch.Tensor,
               exec_masks: torch.Tensor | None = None,
               resets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode pcm [B, F*1920] and decode codes [B, K, F] frame by frame with one state.

    exec_masks / resets: [F, B] bool; a reset is applied before its frame.
    Returns (codes [B, K, F], audio [B, F, 1920]).
    """
    batch, frames = codes.shape[0], codes.shape[-1]
    state = mimi.init_state(batch, "cpu")
    out_codes, out_audio = [], []
    for f in range(frames):
        if resets is not None:
            state.reset(resets[f])
        run = exec_masks[f] if exec_masks is not None else torch.ones(batch, dtype=torch.bool)
        out_codes.append(mimi.encode_step(pcm[:, f * FRAME_SAMPLES:(f + 1) * FRAME_SAMPLES], state, run))
        out_audio.append(mimi.decode_step(codes[:, :, f], state, run))
    return torch.stack(out_codes, dim=-1), torch.stack(out_audio, dim=1)


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """The tiny ops here gain nothing from intra-op threads, and on a loaded machine the
    thread pool's spin-waits make them tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_cfg() -> MimiConfig:
    return tiny_mimi_config()


@pytest.fixture(scope="module")
def tiny_mimi(tiny_cfg: MimiConfig) -> Mimi:
    return random_mimi(tiny_cfg, seed=0)


# ----------------------------------------------------------------------------- reference fidelity

def _reference(cfg: MimiConfig, seed: int):
    loaders = pytest.importorskip("moshi.models.loaders", reason="the reference moshi==0.2.13 is not installed")
    ref = loaders.get_mimi(None, reference_config(cfg), num_codebooks=cfg.num_codebooks)
    state = ref.state_dict()
    randomize_mimi_state_(state, seed)
    ref.load_state_dict(state)
    ours = Mimi(cfg)
    ours.load_state_dict({published_key(k): v for k, v in ref.state_dict().items()}, strict=True)
    return ref, ours


@torch.no_grad()
def _reference_stream(ref, pcm: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's streaming encode of pcm and streaming decode of codes, frame by frame."""
    batch, frames = codes.shape[0], codes.shape[-1]
    with ref.streaming(batch):
        ref_codes = torch.cat([ref.encode(pcm[:, None, f * FRAME_SAMPLES:(f + 1) * FRAME_SAMPLES])
                               for f in range(frames)], dim=-1)
    with ref.streaming(batch):
        ref_audio = torch.stack([ref.decode(codes[:, :, f:f + 1])[:, 0] for f in range(frames)], dim=1)
    return ref_codes, ref_audio


@pytest.mark.oracle
@pytest.mark.parametrize("cfg", [tiny_mimi_config(), MimiConfig()], ids=["tiny", "published"])
def test_state_dict_keys_are_the_published_names(cfg: MimiConfig):
    """Our keys = the reference's keys with the attention projections under the published
    file's names (`self_attn.in_proj_weight`, `self_attn.out_proj.weight`); same shapes.
    (Only the order within a layer's attention differs: the reference lists out_projs first.)"""
    loaders = pytest.importorskip("moshi.models.loaders", reason="the reference moshi==0.2.13 is not installed")
    ref = loaders.get_mimi(None, reference_config(cfg), num_codebooks=cfg.num_codebooks)
    ours = Mimi(cfg).state_dict()
    theirs = {published_key(k): v for k, v in ref.state_dict().items()}
    assert len(ours) == len(theirs) == len(ref.state_dict())
    assert set(ours) == set(theirs)
    assert {model_key(k) for k in ref.state_dict()} == set(ours)
    assert "encoder_transformer.transformer.layers.0.self_attn.in_proj_weight" in ours
    assert "decoder_transformer.transformer.layers.0.self_attn.out_proj.weight" in ours
    assert not any("in_projs" in k or "out_projs" in k for k in ours)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert all(v.dtype == torch.float32 for v in ours.values())


@pytest.mark.oracle
def test_reference_loads_our_state_dict(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """Our state_dict is a valid published file for the reference (its load hook renames)."""
    loaders = pytest.importorskip("moshi.models.loaders", reason="the reference moshi==0.2.13 is not installed")
    ref = loaders.get_mimi(None, reference_config(tiny_cfg), num_codebooks=tiny_cfg.num_codebooks)
    ref.load_state_dict(tiny_mimi.state_dict(), strict=True)
    theirs = ref.state_dict()
    for key, value in tiny_mimi.state_dict().items():
        assert torch.equal(theirs[reference_key(key)], value), key


def test_reference_attention_names_load_strictly(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """A state dict in the reference's in-memory naming (`self_attn.in_projs.0.weight` /
    `out_projs.0.weight`) also loads; `model_key` maps its names to ours."""
    in_memory = {reference_key(k): v.clone() for k, v in tiny_mimi.state_dict().items()}
    assert "encoder_transformer.transformer.layers.0.self_attn.in_projs.0.weight" in in_memory
    assert {model_key(k) for k in in_memory} == set(tiny_mimi.state_dict())
    loaded = Mimi(tiny_cfg)
    loaded.load_state_dict(in_memory, strict=True)
    for key, value in tiny_mimi.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    pcm = chirp_and_noise(1, 3, seed=5)
    assert torch.equal(loaded.encode(pcm), tiny_mimi.encode(pcm))


@pytest.mark.oracle
def test_streaming_matches_reference(tiny_cfg: MimiConfig):
    """>= 50 frames: identical codes, decoded audio within 1e-4 of the reference's streaming decode."""
    ref, ours = _reference(tiny_cfg, seed=1)
    pcm = chirp_and_noise(2, FRAMES, seed=2)
    codes_in = random_codes(2, FRAMES, tiny_cfg, seed=3)
    ref_codes, ref_audio = _reference_stream(ref, pcm, codes_in)
    codes, audio = run_stream(ours, pcm, codes_in)

    assert codes.shape == ref_codes.shape == (2, tiny_cfg.num_codebooks, FRAMES)
    assert len(torch.unique(ref_codes)) > 100, "degenerate test: too few distinct codes"
    assert torch.equal(codes, ref_codes)
    assert (audio - ref_audio).abs().max().item() <= 1e-4


@pytest.mark.oracle
def test_streaming_matches_reference_published_shapes():
    """The published shapes (8 layers of d 512, 32 codebooks of 2048), random weights, a few frames."""
    cfg = MimiConfig()
    ref, ours = _reference(cfg, seed=4)
    frames = 3
    pcm = chirp_and_noise(1, frames, seed=5)
    codes_in = random_codes(1, frames, cfg, seed=6)
    ref_codes, ref_audio = _reference_stream(ref, pcm, codes_in)
    codes, audio = run_stream(ours, pcm, codes_in)
    assert torch.equal(codes, ref_codes)
    assert (audio - ref_audio).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- per-row state

def test_row_ignores_the_other_rows_contents(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """Same batch size, different audio and codes in rows 1-2: row 0 is bit-identical."""
    frames = 12
    pcm_a, pcm_b = chirp_and_noise(3, frames, seed=10), chirp_and_noise(3, frames, seed=11)
    codes_a, codes_b = random_codes(3, frames, tiny_cfg, seed=12), random_codes(3, frames, tiny_cfg, seed=13)
    pcm_b[0], codes_b[0] = pcm_a[0], codes_a[0]
    codes_1, audio_1 = run_stream(tiny_mimi, pcm_a, codes_a)
    codes_2, audio_2 = run_stream(tiny_mimi, pcm_b, codes_b)
    assert torch.equal(codes_1[0], codes_2[0])
    assert torch.equal(audio_1[0], audio_2[0])
    assert not torch.equal(audio_1[1], audio_2[1])


def test_row_alone_equals_row_in_batch(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """B=1 vs B=3: identical codes; audio equal up to float rounding.

    CPU GEMM/conv kernels pick their blocking from the batch size, so the last bits of a row's
    audio may depend on B (not on the other rows' contents: see the test above, bit-exact).
    """
    frames = 12
    pcm = chirp_and_noise(3, frames, seed=20)
    codes_in = random_codes(3, frames, tiny_cfg, seed=21)
    batch_codes, batch_audio = run_stream(tiny_mimi, pcm, codes_in)
    for row in range(3):
        alone_codes, alone_audio = run_stream(tiny_mimi, pcm[row:row + 1], codes_in[row:row + 1])
        assert torch.equal(alone_codes[0], batch_codes[row])
        torch.testing.assert_close(alone_audio[0], batch_audio[row], rtol=0, atol=1e-5)


def test_reset_and_mask_isolate_rows(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """Reset row 1 at frame 7, mask row 2 on frames 4-8.

    Row 0 is bit-identical to an undisturbed run; row 1 restarts exactly like a fresh run
    fed from frame 7; row 2 resumes exactly where it stopped (its executed frames equal an
    unmasked run of just those frames).
    """
    frames, reset_at, masked = 14, 7, range(4, 9)
    pcm = chirp_and_noise(3, frames, seed=30)
    codes_in = random_codes(3, frames, tiny_cfg, seed=31)
    exec_masks = torch.ones(frames, 3, dtype=torch.bool)
    exec_masks[list(masked), 2] = False
    resets = torch.zeros(frames, 3, dtype=torch.bool)
    resets[reset_at, 1] = True

    codes, audio = run_stream(tiny_mimi, pcm, codes_in, exec_masks, resets)
    base_codes, base_audio = run_stream(tiny_mimi, pcm, codes_in)

    # Row 0: untouched by its neighbours' reset and mask.
    assert torch.equal(codes[0], base_codes[0])
    assert torch.equal(audio[0], base_audio[0])

    # Row 1 from the reset on == a fresh stream of the same input (same batch size: bit-exact).
    tail = slice(reset_at * FRAME_SAMPLES, None)
    fresh_codes, fresh_audio = run_stream(tiny_mimi, pcm[:, tail], codes_in[:, :, reset_at:])
    assert torch.equal(codes[1, :, reset_at:], fresh_codes[1])
    assert torch.equal(audio[1, reset_at:], fresh_audio[1])
    # ... and the same codes as a fresh B=1 run (audio up to float rounding, see above).
    alone_codes, alone_audio = run_stream(tiny_mimi, pcm[1:2, tail], codes_in[1:2, :, reset_at:])
    assert torch.equal(codes[1, :, reset_at:], alone_codes[0])
    torch.testing.assert_close(audio[1, reset_at:], alone_audio[0], rtol=0, atol=1e-5)

    # Row 2: its executed frames == an unmasked run that never saw the masked frames.
    kept = [f for f in range(frames) if f not in masked]
    pcm_kept = pcm.view(3, frames, FRAME_SAMPLES)[:, kept].reshape(3, -1)
    kept_codes, kept_audio = run_stream(tiny_mimi, pcm_kept, codes_in[:, :, kept])
    assert torch.equal(codes[2, :, kept], kept_codes[2])
    assert torch.equal(audio[2, kept], kept_audio[2])


def test_encoder_and_decoder_states_reset_separately(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    state = tiny_mimi.init_state(2, "cpu")
    run = torch.ones(2, dtype=torch.bool)
    pcm = chirp_and_noise(2, 2, seed=40)
    codes = random_codes(2, 2, tiny_cfg, seed=41)
    for f in range(2):
        tiny_mimi.encode_step(pcm[:, f * FRAME_SAMPLES:(f + 1) * FRAME_SAMPLES], state, run)
        tiny_mimi.decode_step(codes[:, :, f], state, run)
    assert state.encoder.transformer.pos.tolist() == [4, 4]  # 2 latent steps per frame
    state.encoder.reset(torch.tensor([True, False]))
    assert state.encoder.transformer.pos.tolist() == [0, 4]
    assert state.decoder.transformer.pos.tolist() == [4, 4]
    state.reset(torch.tensor([False, True]))
    assert state.decoder.transformer.pos.tolist() == [4, 0]
    assert isinstance(state, MimiState)


def test_whole_signal_helpers_pad_and_match_streaming(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    pcm = chirp_and_noise(2, 4, seed=50)
    codes = tiny_mimi.encode(pcm[:, :-100])  # padded up to 4 whole frames
    assert codes.shape == (2, tiny_cfg.num_codebooks, 4) and codes.dtype == torch.long
    streamed_codes, streamed_audio = run_stream(tiny_mimi, pcm, codes)
    assert torch.equal(codes[:, :, :3], streamed_codes[:, :, :3])
    audio = tiny_mimi.decode(codes)
    assert audio.shape == (2, 4 * FRAME_SAMPLES)
    assert torch.equal(audio, streamed_audio.reshape(2, -1))


def test_steps_reject_wrong_shapes(tiny_mimi: Mimi):
    state = tiny_mimi.init_state(1, "cpu")
    run = torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match="1920"):
        tiny_mimi.encode_step(torch.zeros(1, 960), state, run)
    with pytest.raises(ValueError, match="codes of shape"):
        tiny_mimi.decode_step(torch.zeros(1, 3, dtype=torch.long), state, run)


# ----------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streaming_matches_cpu_and_graph_capture(tiny_cfg: MimiConfig, tiny_mimi: Mimi):
    """Streaming on CUDA equals CPU within tolerance (masked row included), and one captured
    CUDA graph of a whole frame (encode + decode) replays exactly like the eager steps."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    frames, batch, masked = 12, 3, (3, 4, 5)
    pcm = chirp_and_noise(batch, frames, seed=60)
    codes_in = random_codes(batch, frames, tiny_cfg, seed=61)
    exec_masks = torch.ones(frames, batch, dtype=torch.bool)
    exec_masks[list(masked), 2] = False

    gpu = copy.deepcopy(tiny_mimi).cuda()
    eager_state, graph_state = gpu.init_state(batch, "cuda"), gpu.init_state(batch, "cuda")
    static_pcm = torch.zeros(batch, FRAME_SAMPLES, device="cuda")
    static_codes = torch.zeros(batch, tiny_cfg.num_codebooks, dtype=torch.long, device="cuda")
    static_run = torch.ones(batch, dtype=torch.bool, device="cuda")

    def frame(state: MimiState) -> tuple[torch.Tensor, torch.Tensor]:
        return gpu.encode_step(static_pcm, state, static_run), gpu.decode_step(static_codes, state, static_run)

    # Warm up on a side stream with a scratch state, then capture one frame on graph_state.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        frame(gpu.init_state(batch, "cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_codes, graph_audio = frame(graph_state)

    codes_out, audio_out = [], []
    for f in range(frames):
        static_pcm.copy_(pcm[:, f * FRAME_SAMPLES:(f + 1) * FRAME_SAMPLES])
        static_codes.copy_(codes_in[:, :, f])
        static_run.copy_(exec_masks[f])
        eager_codes, eager_audio = frame(eager_state)
        graph.replay()
        assert torch.equal(graph_codes, eager_codes)
        torch.testing.assert_close(graph_audio, eager_audio, rtol=0, atol=1e-6)
        codes_out.append(eager_codes.cpu())
        audio_out.append(eager_audio.cpu())
    codes, audio = torch.stack(codes_out, dim=-1), torch.stack(audio_out, dim=1)

    # Against CPU: rows 0-1 ran every frame; row 2's executed frames equal a run without the masked ones.
    kept = [f for f in range(frames) if f not in masked]
    cpu_codes, cpu_audio = run_stream(tiny_mimi, pcm, codes_in)
    pcm_kept = pcm.view(batch, frames, FRAME_SAMPLES)[:, kept].reshape(batch, -1)
    kept_codes, kept_audio = run_stream(tiny_mimi, pcm_kept, codes_in[:, :, kept])
    torch.testing.assert_close(audio[:2], cpu_audio[:2], rtol=0, atol=1e-4)
    torch.testing.assert_close(audio[2, kept], kept_audio[2], rtol=0, atol=1e-4)
    # Codes: float rounding differs across devices, so a near-tie may flip an acoustic level.
    same = torch.cat([(codes[:2] == cpu_codes[:2]).flatten(), (codes[2, :, kept] == kept_codes[2]).flatten()])
    assert torch.equal(codes[:2, 0], cpu_codes[:2, 0]) and torch.equal(codes[2, 0, kept], kept_codes[2, 0])
    assert same.float().mean().item() >= 0.95


def _published_shape_mimi(device: str) -> Mimi:
    """Full-size Mimi, random weights and random codebooks (so codes and audio are not degenerate)."""
    mimi = Mimi(MimiConfig()).to(device).eval()
    for module in mimi.modules():
        if hasattr(module, "refresh_embedding"):
            module.embedding_sum.normal_()
            module.refresh_embedding()
    return mimi


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_mimi_stays_within_its_stated_tolerance(device):
    """`mimi.compute_in(torch.bfloat16)` (--mimi-dtype bfloat16), full-size Mimi with random codebooks:
    fp32 pcm in and out; the codes of 4 rows x 6 frames agree with fp32's at least 95 % (the
    semantic codebook too), and decoding the same codes gives audio within 40 dB SNR of fp32's
    (on the H200 at B = 64: 100 % and 49.6 dB, docs/benchmarks.md). Random codebooks lie far from the
    latents and hide near-ties: with codebooks fitted to them, 89 % of the semantic codes agree with the
    reference's exact float32 (benchmarks/mimi_quality.py), which is why bf16 stays opt-in."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    mimi = _published_shape_mimi(device)
    half = copy.deepcopy(mimi).compute_in(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and mimi.dtype == torch.float32
    batch, frames = 4, 6
    pcm = torch.randn(batch, frames, FRAME_SAMPLES, device=device) * 0.1
    codes = torch.randint(0, 2048, (batch, frames, mimi.num_codebooks), device=device)
    run = torch.ones(batch, dtype=torch.bool, device=device)
    results = []
    for model in (mimi, half):
        state = model.init_state(batch, device)
        enc = torch.stack([model.encode_step(pcm[:, f], state, run) for f in range(frames)], 1)
        dec = torch.stack([model.decode_step(codes[:, f], state, run) for f in range(frames)], 1)
        assert dec.dtype == torch.float32
        results.append((enc, dec))
    (c32, a32), (c16, a16) = results
    assert (c16 == c32).float().mean().item() >= 0.95
    assert (c16[..., 0] == c32[..., 0]).float().mean().item() >= 0.95
    snr = 10 * torch.log10(a32.pow(2).sum() / (a16 - a32).pow(2).sum()).item()
    assert snr >= 40, f"bf16 decode SNR {snr:.1f} dB"


def test_float16_keeps_the_codes_that_bf16_moves(tiny_mimi: Mimi):
    """With codebooks fitted to the latents (as a trained codec's lie, among the data: the near-ties
    random ones hide), float16, what `--mimi-dtype auto` takes on CUDA, keeps at least 90 % of
    float32's semantic codes and decodes float32's codes at least 10 dB nearer float32 than bf16
    does. (Published shapes on the H200, against the reference's exact float32: float16 98.5 %
    at 58-60 dB, bf16 89 % at 40-42 dB, the reference itself on a GPU 99 %; docs/benchmarks.md.)"""
    mimi = copy.deepcopy(tiny_mimi)
    g = torch.Generator().manual_seed(0)
    fit_codebooks_(mimi, 0.3 * torch.randn(256, 8 * FRAME_SAMPLES, generator=g), seed=0)  # 2048 latent frames
    pcm = 0.3 * torch.randn(8, 8 * FRAME_SAMPLES, generator=g)
    codes = mimi.encode(pcm)  # streaming, frame by frame: [B, K, F]
    audio = mimi.decode(codes)
    results = {}
    for dtype in (torch.float16, torch.bfloat16):
        half = copy.deepcopy(mimi).compute_in(dtype)
        enc, dec = half.encode(pcm), half.decode(codes)
        semantic = (enc[:, 0] == codes[:, 0]).float().mean().item()
        snr = 10 * torch.log10(audio.pow(2).sum() / (dec - audio).pow(2).sum()).item()
        results[dtype] = semantic, snr
    (semantic16, snr16), (_, snr_bf16) = results[torch.float16], results[torch.bfloat16]
    assert semantic16 >= 0.9, results
    assert snr16 >= snr_bf16 + 10, results


def test_meta_module_assigned_a_state_dict_derives_its_centroids(tiny_mimi: Mimi):
    """load_state_dict(assign=True) over a meta-device Mimi (the benchmarks share weights so):
    the codebooks' derived buffers (centroids, their norms) are made from the statistics."""
    mimi = Mimi(tiny_mimi.cfg).to("meta")
    mimi.load_state_dict(tiny_mimi.state_dict(), assign=True, strict=True)
    assert not [n for n, t in [*mimi.named_parameters(), *mimi.named_buffers()] if t.is_meta]
    ours, theirs = mimi.quantizer.rvq_rest.codebook(1), tiny_mimi.quantizer.rvq_rest.codebook(1)
    assert torch.equal(ours.embedding, theirs.embedding)
    assert torch.equal(ours._squared_norms, theirs.embedding.pow(2).sum(-1))


@pytest.mark.gpu
def test_cuda_nearest_centroid_matches_cdist():
    """The CUDA codebook search (|c|^2 - 2 x.c, one matmul) picks cdist's centroid."""
    if not torch.cuda.is_available() or not kernels.have_triton():
        pytest.skip("needs a CUDA device and Triton")
    torch.manual_seed(0)
    book = Codebook(256, 2048).cuda()
    book.embedding_sum.normal_()
    book.cluster_usage.uniform_(0.5, 2.0)
    book.refresh_embedding()
    x = torch.randn(512, 256, device="cuda")
    fast = book.encode(x)
    with kernels.enabled(False):
        plain = book.encode(x)
    assert (fast == plain).float().mean().item() >= 0.999  # only exact near-ties may differ


@pytest.mark.gpu
def test_gpu_fast_paths_match_plain_path():
    """CUDA-only Mimi fast paths (matmul attention and fused RoPE + ring write for the T = 2 steps,
    matmul transposed convs)
    against the plain PyTorch ops on the same GPU, full-size Mimi with random codebooks."""
    if not torch.cuda.is_available() or not kernels.have_triton():
        pytest.skip("needs a CUDA device and Triton")
    torch.manual_seed(0)
    mimi = _published_shape_mimi("cuda")
    batch, frames = 4, 6
    pcm = torch.randn(batch, frames, FRAME_SAMPLES, device="cuda") * 0.1
    codes = torch.randint(0, 2048, (batch, frames, mimi.num_codebooks), device="cuda")
    run = torch.tensor([True, False, True, True], device="cuda")
    results = []
    for fast in (True, False):
        with kernels.enabled(fast):
            state = mimi.init_state(batch, "cuda")
            enc = [mimi.encode_step(pcm[:, f], state, run) for f in range(frames)]
            dec = [mimi.decode_step(codes[:, f], state, run) for f in range(frames)]
        results.append((torch.stack(enc, 1), torch.stack(dec, 1)))
    # Row 1 never executes: its outputs are not read (the fused ring write leaves its ring as it
    # was, so it attends over other keys than the plain path's write-then-restore).
    rows = run.nonzero().flatten()
    (c_fast, a_fast), (c_plain, a_plain) = ((c[rows], a[rows]) for c, a in results)
    assert (c_fast == c_plain).float().mean().item() >= 0.95
    scale = a_plain.abs().max().item()
    assert (a_fast - a_plain).abs().max().item() <= 1e-3 * scale + 1e-6
