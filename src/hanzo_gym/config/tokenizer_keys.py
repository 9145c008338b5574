"""The tokenizer and how conversations become tokens: where the tokenizer comes from (`tokenizer_config`, or
Mistral's own library), which tokens play the special roles, tokens added to the vocabulary (and the embedding
growth that follows), the chat template and the tokens that end a turn. model/hub.py and renderers/ act on them."""

from __future__ import annotations

from pydantic import field_validator

from hanzo_gym.config.axolotl_keys import close_misspelling
from hanzo_gym.config.feature import Feature, StrictKeys


class SpecialTokens(StrictKeys):
    """Axolotl's `special_tokens`: which tokens play these roles (a token the vocabulary lacks is added, as
    Axolotl adds it), and `additional_special_tokens`, added to the vocabulary as special tokens."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None


def known_chat_template(value: str | None) -> str | None:
    """`value` if it names a chat template or is one; ValueError saying what is allowed otherwise."""
    from hanzo_gym.renderers.chat_templates import (
        FALLBACK_PREFIX,
        TOKENIZER_DEFAULT,
        is_jinja,
        template_names,
    )

    if value is None or is_jinja(value):
        return value
    name = value.removeprefix(FALLBACK_PREFIX)
    if value != TOKENIZER_DEFAULT and name not in template_names():
        close = close_misspelling(name, template_names())
        hint = f"did you mean `{close}`? " if close else ""
        raise ValueError(
            f"unknown template; {hint}use {TOKENIZER_DEFAULT}, {FALLBACK_PREFIX}<name>, inline Jinja, "
            f"or one of {', '.join(template_names())}"
        )
    return value


class TokenizerKeys(Feature):
    tokenizer_config: str | None = None
    tokenizer_type: str | None = None  # Axolotl's tokenizer class, checked against what loads
    # Mistral's own tokenizer library encodes the chats (Axolotl's default: on for a Magistral model)
    tokenizer_use_mistral_common: bool | None = None
    special_tokens: SpecialTokens | None = None
    tokens: list[str] | None = None  # added to the vocabulary (their embeddings must train)
    resize_token_embeddings_to_32x: bool = False  # Axolotl's: grow the embeddings to a multiple of 32 rows
    # grown embedding rows start at the mean of the old ones; Axolotl's default: the model's own initialisation
    mean_resizing_embeddings: bool = False
    chat_template: str | None = None
    # the tokens that end a turn, trained with it (renderers/chat_templates.py)
    eot_tokens: list[str] | None = None

    _known_chat_template = field_validator("chat_template")(known_chat_template)

    @property
    def uses_mistral_common(self) -> bool:
        """Axolotl's rule: `tokenizer_use_mistral_common`, and when unset, on for a Magistral model."""
        if self.tokenizer_use_mistral_common is not None:
            return self.tokenizer_use_mistral_common
        names = (self.base_model, self.tokenizer_config or "")
        return any("magistral" in name.lower() for name in names)

    @property
    def special_token_roles(self) -> dict[str, str]:
        """`special_tokens` as role → token text, the roles set only."""
        if self.special_tokens is None:
            return {}
        return self.special_tokens.model_dump(exclude_none=True, exclude={"additional_special_tokens"})

    @property
    def tokens_the_config_may_add(self) -> tuple[str, ...]:
        """`tokens`, the special tokens' texts and the additional special tokens: each added to the vocabulary
        where the tokenizer lacks it."""
        extra = (self.special_tokens.additional_special_tokens or []) if self.special_tokens else []
        return (*(self.tokens or ()), *self.special_token_roles.values(), *extra)

    def check(self) -> None:
        if self.uses_mistral_common:
            self._check_mistral_common()

    def _check_mistral_common(self) -> None:
        """What Axolotl refuses beside mistral-common's tokenizer, whose vocabulary and chat format are its own."""
        refused = {
            "special_tokens": self.special_tokens is not None,
            "tokens": bool(self.tokens),
            "chat_template": self.chat_template is not None,
            "eot_tokens": bool(self.eot_tokens),
        }
        for key, given in refused.items():
            if given:
                raise ValueError(
                    f"`{key}` with tokenizer_use_mistral_common: mistral-common's tokenizer fixes the vocabulary, "
                    "its special tokens and how chats are written (Axolotl refuses this too); remove it"
                )
