"""PTX instructions inside Pallas Triton kernels (inline asm, elementwise), each with an integer emulation that
interpret mode runs instead and the tests check against an independent construction:

- `dp4a`: c + the four signed byte products of two int32 words, one instruction (the integer weight-only
  product's inner step).
- `nibbles_to_bf16`: int4 codes, two a byte, to bf16 values 128 + v, four bytes at a time: two byte permutes
  spread bytes b0..b3 over the low halves of two words (b0 | b1 << 16, b2 | b3 << 16), for the high nibbles a
  shift by 4, then one LOP3 each keeps the nibble in both halves and sets the bf16 exponent 0x4300.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

SPREAD_LOW, SPREAD_HIGH = 0x4140, 0x4342  # prmt selectors: (b0, 0, b1, 0) and (b2, 0, b3, 0); 4: the zero operand
NIBBLE_MASK, BF16_128 = 0x000F000F, 0x43004300
AND_THEN_OR = 0xEA  # LOP3's truth table for (a & b) | c


def byte_words(codes):
    """Four integer arrays of byte codes -> one array of 32-bit words (the codes' dtype, int32 or uint32), byte j
    holding codes[j]: the operands dp4a and the "prmt" program take."""
    return functools.reduce(jnp.bitwise_or, [(c & 0xFF) << (8 * j) for j, c in enumerate(codes)])


def dp4a(a, b, c):
    """c + the four signed byte products of int32 words a and b, summed: PTX dp4a.s32.s32, one instruction."""
    (out,) = plt.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return out


def dp4a_emulated(a, b, c):
    """dp4a in integer arithmetic: byte j sign-extended by shifting it to the top."""
    for j in range(4):
        c = c + ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
    return c


def nibbles_to_bf16(q_bytes, *, high: bool, interpret: bool):
    """bf16 128 + the low (or high) nibble of each byte of q_bytes [R, C] uint8. In interpret mode the same
    program in integers, on words of four neighbouring bytes (C a multiple of 4): the asm is elementwise within
    its four bytes, so any grouping checks it."""
    if interpret:
        rows, cols = q_bytes.shape
        codes = q_bytes.astype(jnp.uint32).reshape(rows, cols // 4, 4)
        out = nibble_program(byte_words([codes[..., i] for i in range(4)]), high)
        halves = jnp.stack([out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16], axis=-1)
        return lax.bitcast_convert_type(halves.reshape(rows, cols).astype(jnp.uint16), jnp.bfloat16)
    shift = "shr.u32 t0, t0, 4; shr.u32 t1, t1, 4; " if high else ""
    asm = (f"{{ .reg .b32 t0, t1; prmt.b32 t0, $2, 0, {SPREAD_LOW:#x}; prmt.b32 t1, $2, 0, {SPREAD_HIGH:#x}; "
           f"{shift}lop3.b32 $0, t0, {NIBBLE_MASK:#010x}, {BF16_128:#x}, {AND_THEN_OR:#x}; "
           f"lop3.b32 $1, t1, {NIBBLE_MASK:#010x}, {BF16_128:#x}, {AND_THEN_OR:#x}; }}")
    (out,) = plt.elementwise_inline_asm(asm, args=[q_bytes], constraints="=r,=r,r", pack=4,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(q_bytes.shape, jnp.bfloat16)])
    return out


def nibble_program(words, high: bool):
    """nibbles_to_bf16's program in integers on 32-bit words of four code bytes (Python ints or uint32 arrays):
    the two output words, each two bf16 (low half first) of 128 + a nibble of bytes (0, 1) and (2, 3)."""
    spread = [prmt_emulated(words, selector) for selector in (SPREAD_LOW, SPREAD_HIGH)]
    if high:
        spread = [t >> 4 for t in spread]
    return [lop3_emulated(t, NIBBLE_MASK, BF16_128, AND_THEN_OR) for t in spread]


def prmt_emulated(word, selector: int):
    """PTX prmt.b32 (default mode) of `word` and a zero second operand: byte i of the result is byte
    (selector >> 4 i) & 7 of the eight (word's four, then four zeros); bit 3 of a selector would replicate that
    byte's sign, which no selector here asks for."""
    out = 0
    for i in range(4):
        pick = (selector >> (4 * i)) & 0xF
        if pick & 0x8:
            raise ValueError(f"selector {selector:#x}: sign-replicate mode is not emulated")
        if pick < 4:
            out = out | (((word >> (8 * pick)) & 0xFF) << (8 * i))
    return out


def lop3_emulated(a, b: int, c: int, table: int):
    """PTX lop3.b32 with a truth table: bit (4 a_i + 2 b_i + c_i) of `table` is result bit i."""
    if not isinstance(a, int):  # a uint32 array: constants past int32's range must be uint32 too
        b, c = jnp.uint32(b), jnp.uint32(c)
    bits = 0xFFFFFFFF if isinstance(a, int) else jnp.uint32(0xFFFFFFFF)
    out = 0
    for inputs in range(8):
        if table >> inputs & 1:
            out = out | ((a if inputs & 4 else a ^ bits) & (b if inputs & 2 else b ^ bits)
                         & (c if inputs & 1 else c ^ bits))
    return out
