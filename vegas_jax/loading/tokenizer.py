"""Text <-> token ids: a `tokenizers` byte-level BPE plus the BOS/EOS policy and the chat template around it.

Encoding and chat rendering follow Hugging Face transformers, the reference: the same ids for the same text, and
the same rendered chat (sandboxed jinja2, trim_blocks, lstrip_blocks). The BOS policy is held here (`add_bos`)
rather than in the backend's post-processor, so there is exactly one place that decides whether BOS is prepended.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from models.config import UnsupportedModelError
from vegas_jax.loading.checkpoint_files import CheckpointError, read_json_object

if TYPE_CHECKING:
    import gguf

# llama.cpp token types (`tokenizer.ggml.token_type`)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre_tokenizer():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_pre_tokenizer():
    # SmolLM's own tokenizer.json (and llama.cpp's "smollm" pre-type) split every digit off before GPT-2's regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _llama3_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# `tokenizer.ggml.pre` -> how text is split before BPE. The vocabulary's merges were learned on one split; another
# would silently give different ids, so an unknown pre-type is refused rather than guessed.
_GGUF_PRE_TOKENIZERS = {
    "default": _gpt2_pre_tokenizer,
    "gpt2": _gpt2_pre_tokenizer,
    "smollm": _smollm_pre_tokenizer,
    "llama-bpe": _llama3_pre_tokenizer,
}


# Pre-types whose vocabulary comes from tiktoken, which looks a whole piece up before merging (llama.cpp sets
# ignore_merges for them).
_WHOLE_PIECES_FIRST = {"llama-bpe"}


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        # BOS is prepended by `encode` alone; a post-processor that also did so would double it.
        backend.post_processor = None
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader") -> "Tokenizer":
        """The tokenizer a GGUF file's `tokenizer.*` metadata describes (byte-level BPE: tokenizer.ggml.model gpt2)."""

        def field(key: str, default: Any = None) -> Any:
            f = reader.get_field(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(f"tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2')")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))}"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges: list[str] = field("tokenizer.ggml.merges")
        if tokens is None or merges is None:
            raise CheckpointError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)

        # Vocabulary entries are stored as the original tokenizer.json spells them: ordinary tokens in the byte-level
        # alphabet, added tokens as raw text. So the vocabulary is taken as-is, and added tokens are re-declared.
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab={token: i for i, token in enumerate(tokens)},
                merges=[tuple(m.split(" ")) for m in merges],
                fuse_unk=False,
                # Llama 3 is tiktoken: a piece that is itself a token is emitted whole, even where the merges would
                # split it (llama.cpp's llama-bpe and transformers' Llama 3 tokenizer.json do the same).
                ignore_merges=pre in _WHOLE_PIECES_FIRST,
            )
        )
        backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()

        bos_id = field("tokenizer.ggml.bos_token_id")
        # End-of-turn and end-of-message ids stop generation too (llama.cpp treats them as end of generation).
        eos_ids = [
            i
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (i := field(f"tokenizer.ggml.{key}")) is not None
        ]
        # Tokens the metadata names (bos, eos, unk, pad) are special even where token_type forgets to mark them.
        named = {field(f"tokenizer.ggml.{key}") for key in ("unknown_token_id", "padding_token_id")}
        named |= {bos_id, *eos_ids}
        special = [i for i, t in enumerate(token_types) if t == _CONTROL or i in named]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        user_defined = [token for token, t in zip(tokens, token_types) if t == _USER_DEFINED]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
            chat_template=field("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, optional generation_config.json and
        chat_template.jinja (which, as in transformers, takes precedence over the config's template)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"missing tokenizer file {tokenizer_file}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise CheckpointError(f"cannot parse tokenizer file {tokenizer_file}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json", required=True)
        generation = _read_json(folder / "generation_config.json", required=False)

        def token_id(value: Any, key: str) -> int | None:
            content = value.get("content") if isinstance(value, Mapping) else value
            if content is None:
                return None
            i = backend.token_to_id(content)
            if i is None:
                raise CheckpointError(f"{folder / 'tokenizer_config.json'}: {key} {content!r} is not in the vocabulary")
            return i

        bos_id = token_id(config.get("bos_token"), "bos_token")
        eos_ids = [i for i in [token_id(config.get("eos_token"), "eos_token")] if i is not None]
        generation_eos = generation.get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        eos_ids += generation_eos or []
        if bos_id is None and generation.get("bos_token_id") is not None:
            bos_id = int(generation["bos_token_id"])
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # the config is silent (Llama 3): BOS is whatever the tokenizer.json post-processor adds
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _named_template(config.get("chat_template"))
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, chat_template=chat_template)

    def save(self, folder: str | Path) -> None:
        """Writes tokenizer.json, tokenizer_config.json and generation_config.json (read back by `from_hf_folder`)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        generation = {"bos_token_id": self.bos_id, "eos_token_id": list(self.eos_ids)}
        for name, payload in (("tokenizer_config.json", config), ("generation_config.json", generation)):
            (folder / name).write_text(json.dumps(payload, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; special-token text in it (`<|im_start|>`) maps to its single id, as in transformers."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return _compile_template(self.chat_template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # As transformers' apply_chat_template: the template writes any BOS itself, so none is added on top.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDecoder:
    """Text of a growing id sequence, released only once its last character is complete.

    Each push decodes a short window (the previously released chunk plus the new ids) instead of the whole sequence;
    decoding the window twice, with and without the new ids, and releasing the difference keeps decoder effects at
    the window's start (a stripped leading space) identical on both sides. A window ending in U+FFFD ends inside a
    multi-byte character and is held back until the next id completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window
        self._read = 0  # ids before this are released

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end decodes as U+FFFD, as `decode` gives)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        window = self._ids[self._prefix :]
        released = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tokenizer.decode(window, self._skip)
        if len(text) <= len(released) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(released) :]


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not required and not path.is_file():
        return {}
    return read_json_object(path)


def _named_template(value: Any) -> str | None:
    # Older configs hold a list of named templates; the one used for plain chat is "default".
    if isinstance(value, list):
        return next((t["template"] for t in value if t.get("name") == "default"), None)
    return value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters, which transformers (and so every template) does not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (templates are untrusted code: sandboxed)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
