"""Instruction prompts: an instruction (and an optional input) written into a fixed text template, then the output.

Axolotl's `alpaca` family (`type: alpaca`, `alpaca:chat`, `alpaca:chatml`, `alpaca:phi`) and its own formats given
as a `type:` mapping (`format`, `no_input_format`, `system_format`, …) are all this one shape: an optional system
block, then a turn template with or without the input, as Axolotl's AlpacaPrompter and user-defined prompter build
them (its spacing kept exactly, quirks included: `alpaca:phi` writes the input straight after `<|end|>`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

ALPACA_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
ALPACA_SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


@dataclass(frozen=True)
class InstructionFormat:
    turn: str  # `{instruction}` and `{input}`
    turn_no_input: str  # `{instruction}`
    system_block: str  # `{system}`; written only when the system text is not empty
    system: str = ""  # the system text of a row with an input (unless the row has its own)
    system_no_input: str = ""  # … and of a row without one
    # the row field that holds a system text of its own, if the format reads one
    field_system: str | None = None

    def prompt(self, instruction: str, input_text: str = "", row_system: str | None = None) -> str:
        """The text before the output: the system block (if any system text), then the turn."""
        if row_system is None:
            row_system = self.system if input_text else self.system_no_input
        head = self.system_block.format(system=row_system) if row_system else ""
        if input_text:
            return head + self.turn.format(instruction=instruction, input=input_text)
        return head + self.turn_no_input.format(instruction=instruction)


def _alpaca(turn: str, turn_no_input: str, system_block: str) -> InstructionFormat:
    return InstructionFormat(turn, turn_no_input, system_block, ALPACA_SYSTEM, ALPACA_SYSTEM_NO_INPUT)


# `alpaca:<style>`; plain `alpaca` is `instruct`.
ALPACA_STYLES = {
    "instruct": _alpaca(
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "### Instruction:\n{instruction}\n\n### Response:\n",
        "{system}\n\n",
    ),
    "chat": _alpaca(
        "USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:", "SYSTEM: {system}\n"
    ),
    "chatml": _alpaca(
        "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\n{system}<|im_end|>\n",
    ),
    "phi": _alpaca(
        "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
        "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
        "<|system|>\n{system}<|end|>\n",
    ),
}


@dataclass(frozen=True)
class Composed:
    """A part of the prompt (or the output) that Axolotl's strategy writes from several row fields, `{name}` each
    (`{article}\n===\n{question}`), or a fixed text when it names none."""

    template: str

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for _, name, _, _ in string.Formatter().parse(self.template) if name)


FieldSpec = str | Composed


def field_names(specs: tuple[FieldSpec | None, ...]) -> tuple[str, ...]:
    """The row fields these instruction, input and output specs read."""
    return tuple(
        name for spec in specs if spec for name in (spec.fields if isinstance(spec, Composed) else (spec,))
    )


# Axolotl's own prompt strategies that users name by module and function (`type: alpaca_chat.load_qa`): each an
# instruction format over fields of its own — (format, (instruction, input or None, output)), each a field's name
# or a text composed of fields.
_CHAT_SYSTEM = (
    "Below is an instruction from a USER that describes a task, paired with an input that provides further context. "
    "The ASSISTANT writes a response that concisely and appropriately completes the request.\n\n"
)
_CHAT_SYSTEM_NO_INPUT = (
    "Below is an instruction from a USER that describes a task. The ASSISTANT writes a response that appropriately "
    "and concisely completes the request.\n\n"
)
_ALPACA_FIELDS = ("instruction", "input", "output")
# context_qa's system text (AlpacaContextPrompter), in the chat style's system block
_CONTEXT_SYSTEM = "Use the following contextual information to concisely answer the question.\n"
_CONTEXT_QA = InstructionFormat(
    ALPACA_STYLES["chat"].turn,
    ALPACA_STYLES["chat"].turn_no_input,
    "SYSTEM: {system}\n",
    _CONTEXT_SYSTEM,
    _CONTEXT_SYSTEM,
)
AXOLOTL_STRATEGIES: dict[str, tuple[InstructionFormat, tuple[FieldSpec, FieldSpec | None, FieldSpec]]] = {
    "alpaca_instruct.load": (ALPACA_STYLES["instruct"], _ALPACA_FIELDS),
    # Axolotl's UnpromptedPrompter: the alpaca turns with no system prompt
    "alpaca_instruct.load_no_prompt": (
        InstructionFormat(
            ALPACA_STYLES["instruct"].turn, ALPACA_STYLES["instruct"].turn_no_input, "{system}\n\n"
        ),
        _ALPACA_FIELDS,
    ),
    # question / answer in Axolotl's AlpacaChatPrompter
    "alpaca_chat.load_qa": (
        InstructionFormat(
            ALPACA_STYLES["chat"].turn,
            ALPACA_STYLES["chat"].turn_no_input,
            "SYSTEM: {system}\n",
            _CHAT_SYSTEM,
            _CHAT_SYSTEM_NO_INPUT,
        ),
        ("question", None, "answer"),
    ),
    # OpenOrca's rows: each its own system prompt, in Axolotl's OpenOrcaSystemDataPrompter (instruct style)
    "alpaca_w_system.load_open_orca": (
        InstructionFormat(
            "### Human:\n{instruction}\n### Additional Context:\n{input}\n### Assistant:\n",
            "### Human:\n{instruction}\n### Assistant:\n",
            "### System:\n{system}\n",
            field_system="system_prompt",
        ),
        ("question", None, "response"),
    ),
    # an article and a question about it, answered (context_qa.load) or not answerable from it (load_404)
    "context_qa.load": (_CONTEXT_QA, (Composed("{article}\n===\n{question}"), None, "answer")),
    "context_qa.load_404": (
        _CONTEXT_QA,
        (
            Composed("{article}\n===\n{unanswerable_question}"),
            None,
            Composed(
                "The context provided does not contain any information about your inquiry. Therefore, I'm unable "
                "to answer your question based on the given context."
            ),
        ),
    ),
    # ContextV2Prompter: no system text, the turn is the instruction as it is
    "context_qa.load_v2": (
        InstructionFormat("{instruction}\n{input}", "{instruction}", "{system}"),
        (Composed("Context: {context}\nQuestion: {question}\n"), None, Composed("Answer: {answer}")),
    ),
}
