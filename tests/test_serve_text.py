"""The text a served completion shows, token by token, on a real byte-level BPE tokenizer: multi-byte
characters split across tokens, stop strings split across tokens, and held-back text."""

from __future__ import annotations

import pytest

from hanzo_gym.serve.text import TextTracker, held_back

TEXT = "Grüße 𝔘𝔫𝔦, 世界! The answer is 42.\nUser: more"


def run(tokenizer, tokens, stop_ids=(), stops=()):
    tracker = TextTracker(tokenizer, stop_ids, stops)
    deltas = []
    for token in tokens:
        tracker.add(token)
        deltas.append(tracker.take()[0])
    tracker.finish()
    deltas.append(tracker.take()[0])
    return tracker, deltas


def test_deltas_add_up_to_the_decoded_text_and_never_show_half_a_character(qwen3_tokenizer):
    tokens = qwen3_tokenizer.encode(TEXT, add_special_tokens=False)
    # The premise: some token ends inside a multi-byte character.
    assert any(qwen3_tokenizer.decode(tokens[: i + 1]).endswith("\ufffd") for i in range(len(tokens)))
    tracker, deltas = run(qwen3_tokenizer, tokens)
    assert "".join(deltas) == TEXT == tracker.text
    assert not any("\ufffd" in d for d in deltas)
    assert tracker.visible_tokens() == len(tokens)


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["\nUser:"], "Grüße 𝔘𝔫𝔦, 世界! The answer is 42."),
        (["𝔫"], "Grüße 𝔘"),
        (["swer", "42"], "Grüße 𝔘𝔫𝔦, 世界! The an"),
    ],
)
def test_a_stop_string_cuts_the_text_and_is_never_streamed(qwen3_tokenizer, stops, expected):
    tokens = qwen3_tokenizer.encode(TEXT, add_special_tokens=False)
    tracker, deltas = run(qwen3_tokenizer, tokens, stops=stops)
    assert "".join(deltas) == expected == tracker.text
    assert tracker.cut_by_stop
    shown = tracker.tokens[: tracker.visible_tokens()]
    # The tokens reported are the fewest whose text covers the shown text.
    assert qwen3_tokenizer.decode(shown).startswith(expected)
    assert not qwen3_tokenizer.decode(shown[:-1]).startswith(expected)


def test_text_that_may_start_a_stop_string_waits_and_a_stop_token_ends_without_text(qwen3_tokenizer):
    assert held_back("the answer\nUs", ["\nUser:"]) == 3
    assert held_back("the answer", ["\nUser:"]) == 0
    end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = qwen3_tokenizer.encode("one\nUs two", add_special_tokens=False)
    tracker = TextTracker(qwen3_tokenizer, {end}, ["\nUser:"])
    seen = []
    for token in tokens:
        tracker.add(token)
        seen.append(tracker.take()[0])
        assert "\nU" not in "".join(seen) or "two" in "".join(seen)  # held until it proves not to be a stop
    tracker.add(end)
    tracker.add(qwen3_tokenizer.encode(" after", add_special_tokens=False)[0])  # nothing follows a stop token
    seen.append(tracker.take()[0])
    assert "".join(seen) == "one\nUs two" == tracker.text
    assert tracker.visible_tokens() == len(tokens)
