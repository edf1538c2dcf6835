"""Where a request stops: stop token ids (EOS among them) and stop strings, found on device by one automaton.

A stop string can end inside a token, span several tokens, or end inside a run of accepted drafts, so it is matched
on the bytes of the emitted text rather than on token ids. For a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2,
Llama 3, Qwen, the test fixtures) the decoded text is the UTF-8 decoding of the concatenated bytes of the tokens
(special tokens skipped), so a string occurs in the text exactly when its UTF-8 bytes occur in those bytes. An
Aho-Corasick automaton over the stop strings' bytes, folded over each token's bytes ahead of time, gives a table
[states, V]: from a state, a token leads to a state and says whether some stop string ended inside it. Stop ids are
tokens that end a request from every state, so a model without stop strings has a one-state table (the stop ids'
column flags). The decode loop walks the table over each iteration's emitted tokens (a [B] gather per token) and
stops a request at the token that completes a stop, as it stops at EOS: no host round trip, and under `serve` the
request's slot is free at once.

The tokens include the one that completed the stop. The text is cut on the host (`cut_text`): it ends before the
stop string (vLLM's default), or after it with `include_stop`. The tokens a stop id ends on are kept in the text as
decoding keeps them (a special token such as EOS decodes to nothing).
"""

from __future__ import annotations

import functools
import json

import numpy as np

from vegas_jax.inputs import InputError

# The table has a row per automaton state, one more than the stop strings' bytes: bounded, so that it stays small
# next to the model (256 bytes: 257 x 49,152 int32 = 51 MB for SmolLM2's vocabulary, replicated on every device).
MAX_STOP_BYTES = 256
STATE_BUCKET = 16  # the table's rows are rounded up to this many, so similar stop sets share one compilation


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes in decoded text (b"" for special tokens, which decoding skips). InputError naming
    `stop` if the tokenizer's decoding is not the concatenation of its tokens' bytes (only a byte-level BPE
    decoder is), checked on every single token against the tokenizer's own decoding."""
    backend = getattr(tokenizer, "backend", None)
    decoder = None if backend is None else json.loads(backend.to_str()).get("decoder") or {}
    if decoder is None or decoder.get("type") != "ByteLevel":
        kind = "no tokenizer" if decoder is None else f"a {decoder.get('type')!r} decoder"
        raise InputError("{stop}: stop strings need a byte-level BPE tokenizer (its text is its tokens' bytes); this "
                         "model has {}", kind)
    alphabet = _byte_of_char()
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    out = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        piece = backend.id_to_token(i)
        if i in special or piece is None:
            out.append(b"")
        elif all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        else:  # as the byte-level decoder does: a piece outside the alphabet (an added token) is its own UTF-8
            out.append(piece.encode("utf-8"))
    decoded = backend.decode_batch([[i] for i in range(len(out))], skip_special_tokens=True)
    bad = [i for i, (b, text) in enumerate(zip(out, decoded)) if b.decode("utf-8", "replace") != text]
    if bad:
        raise InputError("{stop}: this tokenizer decodes token {} as {!r}, not as its bytes; stop strings need a "
                         "byte-level BPE tokenizer", bad[0], decoded[bad[0]])
    return out


def _automaton(patterns: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes: (next state [S, 256] int32, whether a pattern ends at the state [S] bool)."""
    goto, ends = [{}], [False]
    for pattern in patterns:
        state = 0
        for byte in pattern:
            if byte not in goto[state]:
                goto.append({})
                ends.append(False)
                goto[state][byte] = len(goto) - 1
            state = goto[state][byte]
        ends[state] = True
    delta = np.zeros((len(goto), 256), np.int32)
    fail = [0] * len(goto)
    queue = list(goto[0].values())  # the root's children fail to the root
    delta[0, list(goto[0])] = queue
    for state in queue:  # breadth first: a state's (shallower) failure state is complete before it
        ends[state] = ends[state] or ends[fail[state]]
        delta[state] = delta[fail[state]]
        for byte, child in goto[state].items():
            fail[child] = delta[fail[state], byte]
            delta[state, byte] = child
            queue.append(child)
    return delta, np.array(ends)


def table(vocab_size: int, stop_ids, strings, token_bytes_: list[bytes] | None) -> np.ndarray:
    """[S, vocab_size] int32: next_state * 2 + (a stop ends in this token), for every state and token; one row when
    there are no stop strings. `token_bytes_` is needed only with strings."""
    if not strings:
        flags = np.zeros((1, vocab_size), np.int32)
        flags[0, list(stop_ids)] = 1
        return flags
    delta, ends = _automaton([s.encode("utf-8") for s in strings])
    pieces = token_bytes_[:vocab_size] + [b""] * max(0, vocab_size - len(token_bytes_))
    lengths = np.array([len(p) for p in pieces])
    padded = np.zeros((vocab_size, max(1, lengths.max())), np.uint8)
    for i, piece in enumerate(pieces):
        padded[i, : len(piece)] = np.frombuffer(piece, np.uint8)
    states = len(delta)
    state = np.broadcast_to(np.arange(states, dtype=np.int32)[:, None], (states, vocab_size)).copy()
    matched = np.zeros((states, vocab_size), bool)
    for k in range(padded.shape[1]):  # byte k of every token that has one, from every state at once
        tokens = np.nonzero(lengths > k)[0]
        after = delta[state[:, tokens], padded[tokens, k][None, :]]
        state[:, tokens] = after
        matched[:, tokens] |= ends[after]
    matched[:, list(stop_ids)] = True
    rows = -(-states // STATE_BUCKET) * STATE_BUCKET  # unreachable padding rows
    out = np.zeros((rows, vocab_size), np.int32)
    out[:states] = state * 2 + matched
    return out


def first_stop(text: str, strings) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in `text` (of those ending at the same place, the longest),
    or None: the occurrence that stopped the request, which stopped at the token that completed it."""
    found = [(i + len(s), -len(s)) for s in strings if (i := text.find(s)) >= 0]
    if not found:
        return None
    end, minus_length = min(found)
    return end + minus_length, end


def cut_text(text: str, strings, include_stop: bool) -> str:
    """`text` cut at `first_stop`: before the stop string, or with `include_stop` after it; all of it if none."""
    found = first_stop(text, strings)
    return text if found is None else text[: found[include_stop]]
