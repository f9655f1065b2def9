"""The engine's TTS text front end (engine/speech.py): words, break tags, voices, conditions,
speed and usage, without a model (a stand-in tokenizer and voice store)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parley.engine import SpeechFrontEnd, SpeechInputError, TtsRequest, UnknownVoice
from parley.engine.speech import DEFAULT_CFG, SPEED_GAIN, conditions_for, speed_bonus
from parley.models.dsm import MAX_BREAK_S
from parley.models.tts import FRAME_RATE


def encode(word: str) -> list[int]:
    return [ord(c) for c in word]  # one token per character


class Voices:
    def __init__(self) -> None:
        self.tensors = {"amy": torch.zeros(1, 4, 3), "bob": torch.ones(1, 4, 3)}
        self.aliases = {"alloy": "amy"}
        self.read = False

    def names(self) -> list[str]:
        return [*self.aliases, *self.tensors]

    def __contains__(self, name: str) -> bool:
        return name in self.aliases or name in self.tensors

    def load(self, name: str) -> torch.Tensor:
        return self.tensors[self.aliases.get(name, name)]

    def read_all(self) -> None:
        self.read = True


def test_words_become_entries_with_the_speaker_token_first_and_usage_counts_their_tokens():
    voices = Voices()
    front = SpeechFrontEnd(encode, voices, sampling={"text_temperature": 0.0})
    request, tokens = front.request("Hi  there", "bob")
    assert isinstance(request, TtsRequest)
    assert [e.text for e in request.entries] == ["Hi", "there"]
    assert request.entries[0].tokens == (1, ord("H"), ord("i"))  # the main speaker opens the first word
    assert request.entries[1].tokens == tuple(map(ord, "there"))
    assert tokens == 3 + 5
    assert request.voices[0] is voices.tensors["bob"]
    assert request.conditions == {"control": "ok", "cfg": DEFAULT_CFG}
    assert request.padding_bonus == 0.0 and request.text_temperature == 0.0
    request.conditions["cfg"] = None  # each request has its own copy
    assert front.conditions["cfg"] == DEFAULT_CFG


def test_a_break_tag_is_a_pad_only_entry_and_an_alias_picks_its_voice():
    voices = Voices()
    front = SpeechFrontEnd(encode, voices, speaker_token=None)
    request, tokens = front.request('one <break time="1.5s"/> two <break time="99s"/>', "alloy")
    assert [(e.text, e.tokens) for e in request.entries] == [
        ("one", tuple(map(ord, "one"))), ("", ()), ("two", tuple(map(ord, "two"))), ("", ())]
    assert request.entries[1].padding == round(1.5 * FRAME_RATE)
    assert request.entries[3].padding == round(MAX_BREAK_S * FRAME_RATE)  # capped
    assert tokens == 6
    assert request.voices[0] is voices.tensors["amy"]


def test_speed_is_the_padding_bonus():
    front = SpeechFrontEnd(encode, Voices())
    assert front.request("hello", "amy", 2.0)[0].padding_bonus == pytest.approx(-SPEED_GAIN)
    assert front.request("hello", "amy", 0.5)[0].padding_bonus == pytest.approx(SPEED_GAIN)
    assert speed_bonus(1.0) == 0.0
    with pytest.raises(SpeechInputError) as err:
        front.request("hello", "amy", 0.0)
    assert err.value.param == "speed"


def test_an_unknown_voice_is_a_value_error_naming_the_voice_and_the_known_ones():
    front = SpeechFrontEnd(encode, Voices())
    with pytest.raises(UnknownVoice) as err:
        front.request("hello", "carol")
    assert isinstance(err.value, SpeechInputError) and isinstance(err.value, ValueError)
    assert (err.value.param, err.value.code, err.value.voice) == ("voice", "invalid_voice", "carol")
    assert err.value.known == ["alloy", "amy", "bob"]
    assert str(err.value) == "unknown voice 'carol' (known: alloy, amy, bob)"
    front.check_voice("alloy")  # an alias is a voice


@pytest.mark.parametrize("text", ["", "   ", '<break time="1s"/>'])
def test_no_words_is_an_input_error(text):
    front = SpeechFrontEnd(encode, Voices())
    with pytest.raises(SpeechInputError) as err:
        front.request(text, "amy")
    assert (err.value.param, err.value.message) == ("input", "input holds no words to speak")


def test_for_checkpoint_reads_every_voice_and_takes_the_models_conditions():
    def checkpoint(names, cfg_values):
        config = SimpleNamespace(conditioners=[SimpleNamespace(name=n) for n in names],
                                 lut_values=lambda name: cfg_values)
        return SimpleNamespace(tokenizer=SimpleNamespace(encode=encode), config=config)

    voices = Voices()
    front = SpeechFrontEnd.for_checkpoint(checkpoint(["control", "cfg"], ["1.0", DEFAULT_CFG]), voices)
    assert voices.read and front.conditions == {"control": "ok", "cfg": DEFAULT_CFG}
    assert front.request("hi", "amy")[1] == 3
    lazy = Voices()
    SpeechFrontEnd.for_checkpoint(checkpoint([], []), lazy, read_voices=False)
    assert not lazy.read
    assert conditions_for(checkpoint(["cfg"], ["1.0"])) == {"cfg": None}  # no distilled value: unconditioned
    assert conditions_for(checkpoint([], [])) == {}
