"""Prompts to token ids: strings through the tokenizer (or the chat template as one user message), conversations
through the chat template, token ids checked and kept (`Engine.encode_prompts`)."""

from __future__ import annotations

from vegas_jax import inputs
from vegas_jax.inputs import InputError


def encode_prompts(tokenizer, vocab_size: int, prompts, chat_template: bool | None = None) -> list[list[int]]:
    """The token ids of a batch of prompts (`inputs.prompt_batch`: a bare string is one prompt). Strings are
    tokenized (through the chat template as one user message when the model has one, unless told otherwise);
    conversations (lists of {"role", "content"} messages) are rendered through the chat template; token ids are
    checked and taken as they are."""
    batch = inputs.prompt_batch(prompts, vocab_size)
    if chat_template is not None:
        chat_template = inputs.boolean(chat_template, "chat_template")
    has_template = tokenizer.chat_template is not None
    use_template = has_template if chat_template is None else chat_template
    if use_template and not has_template:
        raise InputError("{chat_template}: the model has no chat template")
    encoded = []
    for i, prompt in enumerate(batch):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if not use_template:
                why = "the model has no chat template" if not has_template else "not with chat_template False"
                raise InputError(inputs.item("prompts", i) + " is a conversation, which the chat template "
                                 "renders: {}", why)
            prompt = _encode_chat(tokenizer, prompt, i)
        elif isinstance(prompt, str):
            if use_template:
                prompt = _encode_chat(tokenizer, [{"role": "user", "content": prompt}], i)
            else:
                prompt = tokenizer.encode(prompt)
        if not prompt:
            raise InputError(inputs.item("prompts", i) + " has no tokens")
        encoded.append(prompt)
    return encoded


def _encode_chat(tokenizer, messages: list[dict], index: int) -> list[int]:
    import jinja2

    try:
        return tokenizer.encode_chat(messages)
    except jinja2.TemplateError as e:  # templates refuse what they cannot render (roles out of turn, say)
        raise InputError(inputs.item("prompts", index) + ": the chat template refused it: {}", e) from None
