"""Helpers shared by the renderer tests: exact token layouts and what a supervised example trains on."""

from __future__ import annotations


def text(tokenizer, tokens) -> str:
    return tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def assert_layout(tokenizer, tokens, expected: str) -> None:
    """The tokens spell `expected` and are exactly what the tokenizer makes of that string, i.e. what the Hugging
    Face template's text tokenises to."""
    assert text(tokenizer, tokens) == expected
    assert list(tokens) == tokenizer.encode(expected, add_special_tokens=False)


def trained_text(renderer, messages, mode) -> str:
    model_input, weights = renderer.build_supervised_example(messages, mode)
    tokens = model_input.to_ints()
    assert len(weights) == len(tokens)
    return text(renderer.tokenizer, [t for t, w in zip(tokens, weights.tolist()) if w == 1.0])


def thought(reasoning: str, answer: str) -> list[dict]:
    return [{"type": "thinking", "thinking": reasoning}, {"type": "text", "text": answer}]


def user(content: str) -> dict:
    return {"role": "user", "content": content}
