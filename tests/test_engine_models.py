"""The engine with the real model stack (ModelBackend) on Parley's tiny and echo checkpoints.

The echo checkpoint repeats each row's user codes one frame later (models/synthetic.py), so
"each session hears exactly its own audio" is checked at the code level, per session.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from parley.engine import Engine, EngineConfig, FrameOut, SamplingOptions, SessionOptions, SessionRejected
from parley.engine.backend import BackendOutput, ModelBackend
from parley.models.config import FRAME_SAMPLES
from parley.models.persona_prompt import SILENCE_TOKENS
from parley.models.synthetic import ECHO_FIRST_FRAME

N = FRAME_SAMPLES
GREEDY = SessionOptions(sampling=SamplingOptions.greedy())


class Recording:
    """Wraps a backend and keeps each tick's live mask and codes (host copies, test only)."""

    def __init__(self, inner: ModelBackend) -> None:
        self.inner = inner
        self.max_sessions = inner.max_sessions
        self.ticks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        out = self.inner.step(frames, live_mask)
        self.ticks.append((live_mask.clone(), out.user_codes.cpu(), out.agent_codes.cpu(), out.valid.cpu()))
        return out

    def row_history(self, row: int):
        """(user codes, agent codes, valid) of the ticks where `row` was live."""
        live = [(u[row], a[row], bool(v[row])) for m, u, a, v in self.ticks if m[row]]
        return (torch.stack([x[0] for x in live]), torch.stack([x[1] for x in live]), [x[2] for x in live])

    def __getattr__(self, name):
        return getattr(self.inner, name)


def speech_like(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(frames * N) / 24_000
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t)
    return (tone + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def frames_of(session) -> list[FrameOut]:
    return [e for e in session.events.drain() if isinstance(e, FrameOut)]


def test_eight_echo_sessions_each_hear_exactly_their_own_audio(echo_dir):
    backend = Recording(ModelBackend.load(echo_dir, 8, seed=0))
    mimi = backend.checkpoint.mimi
    engine = Engine(backend, EngineConfig(output_events=64))
    ticks = 6
    inputs = [speech_like(i, ticks) for i in range(8)]

    async def main():
        sessions = [engine.open_nowait(GREEDY) for _ in range(8)]
        engine.run_ticks(1)
        for s, pcm in zip(sessions, inputs):
            await s.ready
            s.push_audio(pcm)
        engine.run_ticks(ticks)
        return sessions, [frames_of(s) for s in sessions]

    sessions, outputs = asyncio.run(main())
    for s, pcm, frames in zip(sessions, inputs, outputs):
        user, agent, valid = backend.row_history(s.row)
        own_codes = mimi.encode(torch.from_numpy(pcm)[None])[0].T  # [ticks, 8], a fresh encoder
        assert torch.equal(user, own_codes), "the row was fed someone else's audio"
        assert valid == [False] + [True] * (ticks - 1)
        for f in range(ECHO_FIRST_FRAME, ticks):
            assert torch.equal(agent[f], user[f - 1]), f"frame {f} is not the echo of frame {f - 1}"
        assert len(frames) == ticks - 1
        # The audio the session got is its own agent codes, decoded from a fresh decoder.
        expected = mimi.decode(agent[1:].T[None])[0].numpy()
        got = np.concatenate([f.pcm for f in frames])
        np.testing.assert_allclose(got, expected, atol=1e-4)
    engine.shutdown()


def run_with_optional_visitor(checkpoint_dir, with_visitor: bool):
    """3 sessions for 9 ticks (default, non-greedy sampling, fixed seed); optionally a
    visitor opens at tick 2, closes at 5 and is replaced at 6 on the same row."""
    backend = ModelBackend.load(checkpoint_dir, 4, seed=1234)
    engine = Engine(backend)

    async def main():
        sessions = [engine.open_nowait(SessionOptions()) for _ in range(3)]
        engine.run_ticks(1)
        for i, s in enumerate(sessions):
            await s.ready
            s.push_audio(speech_like(i, 9))
        visitor = replacement = None
        for tick in range(9):
            if with_visitor and tick == 2:
                visitor = engine.open_nowait(SessionOptions())
                visitor.push_audio(speech_like(50, 9))
            if with_visitor and tick == 5:
                visitor.close()
            if with_visitor and tick == 6:
                replacement = engine.open_nowait(GREEDY)
                replacement.push_audio(speech_like(51, 3))
            engine.run_ticks(1)
        if with_visitor:
            assert visitor.row == replacement.row == 3
        return [frames_of(s) for s in sessions]

    out = asyncio.run(main())
    engine.shutdown()
    return out


def test_a_visitor_leaves_other_sessions_bit_identical(tiny_moshi_dir):
    baseline = run_with_optional_visitor(tiny_moshi_dir, False)
    visited = run_with_optional_visitor(tiny_moshi_dir, True)
    for base, other in zip(baseline, visited):
        assert len(base) == len(other) == 8
        assert [f.pcm.tobytes() for f in base] == [f.pcm.tobytes() for f in other]
        assert [f.text_token for f in base] == [f.text_token for f in other]


def test_a_reused_slot_starts_clean(tiny_moshi_dir):
    def session_outputs(warm_up_first: bool):
        backend = ModelBackend.load(tiny_moshi_dir, 2, seed=7)
        engine = Engine(backend)

        async def main():
            if warm_up_first:  # someone else talks on row 0 first, then leaves
                first = engine.open_nowait(GREEDY)
                engine.run_ticks(1)
                first.push_audio(speech_like(9, 4))
                engine.run_ticks(4)
                first.close()
            s = engine.open_nowait(GREEDY)
            engine.run_ticks(1)
            await s.ready
            assert s.row == 0
            s.push_audio(speech_like(3, 5))
            engine.run_ticks(5)
            return frames_of(s)

        out = asyncio.run(main())
        engine.shutdown()
        return out

    fresh, reused = session_outputs(False), session_outputs(True)
    assert len(fresh) == 4
    assert [f.pcm.tobytes() for f in fresh] == [f.pcm.tobytes() for f in reused]
    assert [f.text_token for f in fresh] == [f.text_token for f in reused]


def test_personaplex_session_is_prefilled_in_one_pass_and_talks(tiny_personaplex_dir):
    backend = ModelBackend.load(tiny_personaplex_dir, 2, seed=0)
    engine = Engine(backend)

    async def main():
        s = engine.open_nowait(SessionOptions(persona="Hi", voice="NATF0", sampling=SamplingOptions.greedy()))
        engine.run_ticks(1)
        await s.ready
        offset = int(backend._lm_state.offsets[s.row])
        assert offset > 12  # voice + 2 x 6 silence + persona frames, all in before the first tick
        s.push_audio(speech_like(0, 3))
        engine.run_ticks(3)
        frames = frames_of(s)
        assert len(frames) == 3  # past the delay already: the prompt filled it
        assert all(np.isfinite(f.pcm).all() for f in frames)
        bad = engine.open_nowait(SessionOptions(voice="NOBODY"))
        engine.run_ticks(1)
        with pytest.raises(SessionRejected, match="NOBODY"):
            await bad.ready
        counters = engine.counters()
        assert counters["prefill_seconds"]["count"] == 1 and counters["free_slots"] == 1

    asyncio.run(main())
    engine.shutdown()


def test_moshi_refuses_a_persona_in_a_sentence(tiny_moshi_dir):
    backend = ModelBackend.load(tiny_moshi_dir, 1)
    engine = Engine(backend)

    async def main():
        s = engine.open_nowait(SessionOptions(persona="be nice"))
        engine.run_ticks(1)
        with pytest.raises(SessionRejected, match="takes no voice or persona"):
            await s.ready

    asyncio.run(main())
    engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_frame_equals_eager_greedy(tiny_moshi_dir):
    def run(graphs: bool):
        backend = ModelBackend.load(tiny_moshi_dir, 4, device="cuda", dtype=torch.float32,
                                    cuda_graphs=graphs, seed=3)
        greedy = SamplingOptions.greedy()
        mask = torch.tensor([True, False, True, True])
        for row in range(4):
            backend.set_sampling(row, greedy)
        outs = []
        for t in range(8):
            if t == 4:  # row 2 starts over (the reset's own graph, engine/row_reset.py)
                backend.reset_rows(torch.tensor([False, False, True, False]))
                backend.set_sampling(2, greedy)
            frames = torch.from_numpy(np.stack([speech_like(10 * t + r, 1) for r in range(4)]))
            host = backend.step(frames, mask).to_host()
            outs.append((host.pcm.copy(), host.text_tokens.copy(), host.valid.copy()))
        backend.close()
        return outs

    eager, graphed = run(False), run(True)
    for (p0, t0, v0), (p1, t1, v1) in zip(eager, graphed):
        np.testing.assert_array_equal(t0, t1)
        np.testing.assert_array_equal(v0, v1)
        np.testing.assert_allclose(p0, p1, atol=1e-5)


def test_personaplex_handoff_rides_in_the_first_tick_and_disturbs_no_one(tiny_personaplex_dir):
    """A prefill costs no extra step: the prompt's last frame runs in the row's first tick
    (PersonaPlex's last silence frame comes out first), and a row already talking gets
    bit-identical outputs whether or not another row is prefilled beside it."""
    voice = SessionOptions(persona="Hi there", voice="NATF0", sampling=SamplingOptions.greedy())
    frames = torch.from_numpy(np.stack([speech_like(1, 12), speech_like(2, 12)])).float()

    def run(open_row0_at: int | None):
        backend = ModelBackend.load(tiny_personaplex_dir, 2, seed=0)
        backend.set_sampling(1, SamplingOptions.greedy())
        outs = []
        for tick in range(12):
            live = torch.tensor([open_row0_at is not None and tick >= open_row0_at, True])
            if tick == open_row0_at:
                backend.reset_rows(torch.tensor([True, False]))
                backend.set_sampling(0, voice.sampling)
                backend.prefill(0, voice)
            batch = torch.stack([frames[0, tick * N:(tick + 1) * N], frames[1, tick * N:(tick + 1) * N]])
            out = backend.step(batch, live)
            outs.append((out.agent_codes.cpu().clone(), out.to_host()))
        return outs

    alone, beside = run(None), run(5)
    for (codes_a, host_a), (codes_b, host_b) in zip(alone, beside):
        assert torch.equal(codes_a[1], codes_b[1])
        assert np.array_equal(host_a.pcm[1], host_b.pcm[1]) and host_a.text_tokens[1] == host_b.text_tokens[1]
    first_codes, first_host = beside[5]
    assert first_host.valid[0]  # the prompt filled the delay: the first tick already has a frame
    assert first_codes[0, 1:].tolist() == list(SILENCE_TOKENS[1:])  # the handoff's forced acoustic codes


def test_a_closed_session_row_is_emptied_at_the_next_tick(tiny_moshi_dir):
    """An idle row must cost (close to) nothing: once its session ends, the row's KV ring is
    emptied at the next tick, so the attention reads nothing for it until the slot is reused."""
    backend = ModelBackend.load(tiny_moshi_dir, 2, seed=0)
    engine = Engine(backend)

    async def main():
        a = engine.open_nowait(GREEDY)
        b = engine.open_nowait(GREEDY)
        engine.run_ticks(1)
        await a.ready
        await b.ready
        a.push_audio(speech_like(0, 4))
        b.push_audio(speech_like(1, 4))
        engine.run_ticks(4)
        state = backend._lm_state
        assert (state.transformer.slot_pos[a.row] >= 0).sum() == 4 and int(state.offsets[a.row]) == 4
        a.close()
        engine.run_ticks(1)
        assert (state.transformer.slot_pos[a.row] == -1).all() and int(state.offsets[a.row]) == 0
        assert int(state.offsets[b.row]) == 5  # the other row went on

    asyncio.run(main())
    engine.shutdown()


def test_a_prompt_prefilled_in_chunks_equals_one_prefilled_whole(tiny_personaplex_dir):
    """The engine may spread a prompt over several ticks' slack: chunks of 7 frames leave the
    row exactly where one pass does (same tokens, same audio within float rounding)."""
    options = SessionOptions(persona="Hi there", voice="NATF0", sampling=SamplingOptions.greedy())
    audio = torch.from_numpy(speech_like(3, 10)).float()
    runs = []
    for chunk in (None, 7):
        backend = ModelBackend.load(tiny_personaplex_dir, 1, seed=0)
        backend.reset_rows(torch.tensor([True]))
        backend.set_sampling(0, options.sampling)
        job = backend.start_prefill(0, options)
        assert job.frames_left > 14
        while job.frames_left:
            job.run(chunk)
        live = torch.tensor([True])
        outs = [backend.step(audio[None, f * N:(f + 1) * N], live) for f in range(10)]
        runs.append((torch.stack([o.agent_codes[0].cpu() for o in outs]), [o.to_host() for o in outs]))
    (codes_whole, host_whole), (codes_chunked, host_chunked) = runs
    assert torch.equal(codes_whole, codes_chunked)
    assert [h.text_tokens[0] for h in host_whole] == [h.text_tokens[0] for h in host_chunked]
    np.testing.assert_allclose(np.stack([h.pcm[0] for h in host_whole]),
                               np.stack([h.pcm[0] for h in host_chunked]), atol=1e-5)


def test_a_refused_voice_and_an_abandoned_prompt_change_no_one_else(tiny_personaplex_dir):
    """Prompts share one prompt state (engine/prompt_prefill.py): a session refused for its
    voice, and one closed halfway through its prompt, leave a talking row bit-identical, and the
    next prompt runs as it would have alone (its row's outputs bit-identical too)."""
    good = SessionOptions(persona="Hi there", voice="NATF0", sampling=SamplingOptions.greedy())
    frames = torch.from_numpy(np.stack([speech_like(s, 10) for s in (1, 2, 3)])).float()

    def run(trouble: bool):
        backend = ModelBackend.load(tiny_personaplex_dir, 3, seed=0)
        backend.set_sampling(2, SamplingOptions.greedy())
        outs = []
        for tick in range(10):
            if trouble and tick == 2:
                with pytest.raises(SessionRejected):
                    backend.start_prefill(1, SessionOptions(voice="no-such-voice"))
                backend.reset_rows(torch.tensor([False, True, False]))
                half = backend.start_prefill(1, good)
                half.run(7)  # ... and its session closes: the row is reset, the prompt dropped
                assert half.frames_left > 0
                backend.reset_rows(torch.tensor([False, True, False]))
            if tick == 4:
                backend.reset_rows(torch.tensor([True, False, False]))
                backend.set_sampling(0, good.sampling)
                backend.prefill(0, good)
            live = torch.tensor([tick >= 4, False, True])
            out = backend.step(frames[:, tick * N:(tick + 1) * N], live)
            outs.append((out.agent_codes.cpu().clone(), out.to_host()))
        return outs

    for (codes_a, host_a), (codes_b, host_b) in zip(run(False), run(True)):
        for row in (0, 2):
            assert torch.equal(codes_a[row], codes_b[row])
            assert np.array_equal(host_a.pcm[row], host_b.pcm[row])
            assert host_a.text_tokens[row] == host_b.text_tokens[row]


def test_admission_names_voices_without_touching_the_voices_folder(tiny_personaplex_dir, copy_checkpoint,
                                                                   monkeypatch):
    """start_prefill runs on the engine thread between ticks: resolving a voice name there
    looked for each candidate file, and an unknown name listed the folder, on every admission
    (a client could repeat that at will). Names now resolve against the voices read at start;
    a voice added to the folder later is refused, saying the folder is read at start."""
    import pathlib

    ckpt = copy_checkpoint(tiny_personaplex_dir)
    backend = ModelBackend.load(ckpt, 2)
    (backend.checkpoint.voices_dir / "LATE.pt").write_bytes((backend.checkpoint.voices_dir / "NATF0.pt").read_bytes())

    def no_filesystem(*args, **kwargs):
        raise AssertionError("the voices folder was read at admission")

    for method in ("is_file", "is_dir", "exists", "iterdir", "stat"):
        monkeypatch.setattr(pathlib.Path, method, no_filesystem)
    for name in ("NATF0", "NATF0.pt", "NATM0"):
        assert backend.start_prefill(0, SessionOptions(voice=name)).frames_left > 0
        backend.reset_rows(torch.tensor([True, False]))
    for name, message in (("LATE", "not found \\(the voices folder is read when the server starts\\)"),
                          ("VARF9", "available voices: NATF0, NATM0"), ("../NATF0.pt", "invalid voice name")):
        with pytest.raises(SessionRejected, match=message):
            backend.start_prefill(1, SessionOptions(voice=name))
    assert backend.voice_names() == ("NATF0.pt", "NATM0.pt")


def test_voices_are_read_at_start_not_when_a_session_is_admitted(tiny_personaplex_dir, copy_checkpoint,
                                                                  monkeypatch, caplog):
    """Reading a voice (an audio one is also loudness-normalised and Mimi-encoded) ran on the
    engine thread at its first session's admission, outside any slack budget; the backend now
    reads every voice when it is built. A voice that cannot be read is logged at start and
    refused to the session that asks for it, naming the problem."""
    import soundfile

    from parley.engine import voice_library as backend_module  # the backend's voices (engine/voice_library.py)

    ckpt = copy_checkpoint(tiny_personaplex_dir)
    voices = ModelBackend.load(ckpt, 2).checkpoint.voices_dir  # (unpacks voices.tgz)
    soundfile.write(voices / "ADA.wav", speech_like(5, 6), 24000)  # 0.48 s: the loudness meter needs 0.4
    (voices / "BROKEN.pt").write_bytes(b"not a voice")
    with caplog.at_level("WARNING", logger="parley.engine.backend"):
        backend = ModelBackend.load(ckpt, 2)
    assert "voice BROKEN.pt cannot be used" in caplog.text

    def no_reading(*args, **kwargs):
        raise AssertionError("a voice was read at admission")

    read = backend_module.load_voice
    monkeypatch.setattr(backend_module, "load_voice", no_reading)
    for name in ("NATF0", "NATF0.pt", "NATM0", "ADA", "ADA.wav"):
        job = backend.start_prefill(0, SessionOptions(voice=name))
        assert job.frames_left > 0
        backend.reset_rows(torch.tensor([True, False]))
    monkeypatch.setattr(backend_module, "load_voice", read)
    with pytest.raises(SessionRejected, match="BROKEN.pt"):
        backend.start_prefill(1, SessionOptions(voice="BROKEN"))
