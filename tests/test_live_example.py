"""examples/duplex_client.py --live: the standalone example holds a GPT-Live conversation with a
Parley server (tiny models): its audio comes back frame for frame, and a delegation answered with
--commentary is said into the model's text stream, which the example writes out."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from server_harness import serve
from test_duplex_client import load_example
from test_live_server import SR, checkpoints, live_app, speech_then_quiet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_example_live_streams_a_file_and_answers_a_delegation_with_commentary(checkpoints, tmp_path):
    wav, out, text_out = tmp_path / "in.wav", tmp_path / "reply.wav", tmp_path / "reply.txt"
    soundfile.write(wav, speech_then_quiet(1.2, 4.8), SR)
    tail = 4.0  # after the turn's end: time for the model to pause and say the commentary
    with serve(live_app(checkpoints)) as base:
        assert load_example().main([str(wav), "--live", "--url", f"http://{base}", "--out", str(out),
                                    "--text-out", str(text_out), "--tail", str(tail),
                                    "--commentary", "hello world"]) == 0  # no --model: the served one
    reply, rate = soundfile.read(out)
    sent_s = 6.0 + tail
    assert rate == SR and 0.7 * sent_s <= reply.size / SR <= sent_s + 1.0  # every frame kept, as sent
    assert "hello world" in text_out.read_text()


def test_example_refuses_two_protocols_and_commentary_without_live(tmp_path, capsys):
    example = load_example()
    for flags in (["--live", "--realtime"], ["--commentary", "hi"]):
        with pytest.raises(SystemExit) as exit_:
            example.main([str(tmp_path / "in.wav"), *flags])
        assert exit_.value.code == 2
    assert "--commentary answers GPT-Live delegations" in capsys.readouterr().err
