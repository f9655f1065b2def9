"""The DSM text state machine: the vectorised rows equal the plain oracle, which equals the
reference package's StateMachine, token for token (including word timing and end of speech)."""

import random

import pytest
import torch

from parley.models.dsm import DsmReference, DsmRows, DsmTokens, WordEntry, split_words

ref_tts = pytest.importorskip("moshi.models.tts")  # the reference package: the test extra

CARD = 101  # text card 100 + 1


def _random_entries(rng: random.Random) -> list[WordEntry]:
    entries = []
    for i in range(rng.randint(0, 9)):
        if rng.random() < 0.15:
            entries.append(WordEntry((), "", rng.randint(0, 6)))
            continue
        tokens = [rng.randint(4, 99) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.05:
            tokens[-1] = 0  # an <unk> piece equals NEW_WORD: the published machine's quirk is kept
        entries.append(WordEntry(tuple(tokens), f"w{i}", len(tokens)))
    return entries


def _sampled(rng: random.Random) -> int:
    return rng.choice([0, 0, 3, 3, 3, 7])


@pytest.mark.parametrize("ahead", [2, 0])
def test_rows_oracle_and_reference_agree(ahead):
    rng = random.Random(ahead)
    batch, steps = 6, 70
    ids = DsmTokens(card=CARD)
    for trial in range(12):
        scripts = [_random_entries(rng) for _ in range(batch)]
        oracles = [DsmReference(ids, s, second_stream_ahead=ahead) for s in scripts]
        machine = ref_tts.StateMachine(ref_tts.TokenIds(CARD), second_stream_ahead=ahead, max_padding=8)
        refs = [machine.new_state([ref_tts.Entry(list(e.tokens), e.text, e.padding) for e in s])
                for s in scripts]
        rows = DsmRows(batch, max_entries=12, max_tokens=40, tokens=ids, second_stream_ahead=ahead)
        for b, s in enumerate(scripts):
            rows.load(b, s)
        # Rows start at different steps and pause at random: each keeps its own clock.
        offsets = torch.zeros(batch, dtype=torch.long)
        row_steps = [0] * batch
        for _ in range(steps):
            active = torch.tensor([rng.random() < 0.8 for _ in range(batch)])
            sampled = [_sampled(rng) for _ in range(batch)]
            got = rows.step(offsets.clone(), torch.tensor(sampled), active)
            for b in range(batch):
                if not active[b]:
                    continue
                want, _ = machine.process(row_steps[b], refs[b], sampled[b])
                assert oracles[b].step(row_steps[b], sampled[b]) == want
                assert int(got[b]) == want, (trial, b, row_steps[b])
                row_steps[b] += 1
            offsets += active.long()
        for b in range(batch):
            assert oracles[b].state.end_step == refs[b].end_step
            assert int(rows.end_step[b]) == (-1 if refs[b].end_step is None else refs[b].end_step)
            word_steps = [int(rows.word_step[b, e]) for e, entry in enumerate(scripts[b])
                          if entry.tokens and int(rows.word_step[b, e]) >= 0]
            assert word_steps == [step for _, step in refs[b].transcript]
            assert oracles[b].state.word_steps == refs[b].transcript


class _Sp:
    """SentencePiece-like encode for the frontend test."""

    def encode(self, word):
        return [4 + (ord(c) % 90) for c in word]


def test_split_words_matches_reference_frontend():
    text = "Hello there: (friend) it\u2019s <break time=\"0.5s\"/> time  to go"
    ours = split_words(text, _Sp().encode, 12.5, padding_between=1)
    theirs = ref_tts.script_to_entries(_Sp(), ref_tts.TokenIds(CARD), 12.5, [text], multi_speaker=True,
                                       padding_between=1)
    assert [(list(e.tokens), e.text, e.padding) for e in ours] == \
        [(e.tokens, e.text, e.padding) for e in theirs]
    assert ours[0].tokens[0] == 1 and ours[4].tokens == () and ours[4].padding == 6


def test_script_too_long_is_refused():
    rows = DsmRows(1, max_entries=2, max_tokens=4, tokens=DsmTokens(CARD))
    with pytest.raises(ValueError, match="too long"):
        rows.load(0, [WordEntry((5,), "a", 1)] * 3)


def test_reloading_a_used_row_equals_a_fresh_load_and_spares_the_others():
    rng = random.Random(7)
    ids = DsmTokens(CARD)
    long_script = [WordEntry((5, 6, 7, 8), "a", 4)] * 9
    short_script = [WordEntry((9,), "b", 1), WordEntry((), "", 3), WordEntry((10, 11), "c", 2)]
    used = DsmRows(3, max_entries=12, max_tokens=40, tokens=ids)
    for b in range(3):
        used.load(b, long_script)
    for t in range(30):
        used.step(torch.full((3,), t), torch.tensor([_sampled(rng) for _ in range(3)]), torch.ones(3, dtype=torch.bool))
    others = used.state[[0, 2]].clone()
    used.load(1, short_script)
    fresh = DsmRows(3, max_entries=12, max_tokens=40, tokens=ids)
    fresh.load(1, short_script)
    assert torch.equal(used.state[1], fresh.state[1])
    assert torch.equal(used.state[[0, 2]], others)
    # The named views read the packed row: the script as laid out, the counters reset.
    assert fresh.tokens[1, :4].tolist() == [9, 10, 11, 0] and fresh.start[1, :3].tolist() == [0, 1, 1]
    assert fresh.length[1, :3].tolist() == [1, 0, 2] and fresh.padding[1, :3].tolist() == [1, 3, 2]
    assert (int(fresh.n_entries[1]), int(fresh.remaining[1]), int(fresh.end_step[1])) == (3, 2, -1)
    assert fresh.word_step[1].eq(-1).all() and int(fresh.end_step[0]) == -1
