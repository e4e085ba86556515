"""The normalise tables' headers: an affine form is claimed only where it equals the table.

The check here is independent of ``_affine``'s own: exact rational arithmetic for the fp32
FMA, rounded to nearest even by hand, then to the 16-bit type, against the CPU path's table.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from mmwire.kernels._affine import BYTE_SCALE, NORM_STRIDE, NORM_VALUES, affine_form, table_rows
from mmwire.kernels.reference import Normalisation, normalise_table, shared_normalise_table

_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
KIMI = Normalisation((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
CLIP = Normalisation(*_CLIP)
IMAGENET = Normalisation((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
QWEN2 = Normalisation(*_CLIP, arithmetic="float32")  # transformers' float32 order
QWEN3 = Normalisation((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), arithmetic="float32")
HALF = (torch.bfloat16, torch.float16)


def _fp32(q: Fraction) -> float:
    """q rounded to the nearest fp32, ties to even (normal range: enough for these tables)."""
    if q == 0:
        return 0.0
    sign, q = (-1, -q) if q < 0 else (1, q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    m = q / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    n, rest = divmod(m.numerator, m.denominator)
    if 2 * rest > m.denominator or (2 * rest == m.denominator and n % 2 == 1):
        n += 1
    return sign * float(Fraction(n) * Fraction(2) ** (e - 23))


def _header(rows: torch.Tensor, g: int = 0) -> np.ndarray:
    words = rows[g, NORM_VALUES:].contiguous().view(torch.uint8).numpy()
    return words[:32].view(np.uint32)


@pytest.mark.parametrize(
    "stats",
    [KIMI, CLIP, IMAGENET, QWEN2, QWEN3],
    ids=["kimi", "clip", "imagenet", "qwen2", "qwen3"],
)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_claimed_affine_form_gives_every_byte_of_the_table(
    stats: Normalisation, dtype: torch.dtype
) -> None:
    rows = table_rows((stats,), dtype)
    assert rows.shape == (1, NORM_STRIDE)
    words = _header(rows)
    assert words[0] == {torch.bfloat16: 1, torch.float16: 2}[dtype]  # claimed, so checked
    table = normalise_table(stats, dtype).view(torch.int16)
    assert torch.equal(rows[0, :NORM_VALUES].view(3, 256), table)
    for c in range(3):
        # the kernel's operands: the byte as v 2^-133 and the header's a (the form's 2^133)
        a = Fraction(float(words[1 + c : 2 + c].view(np.float32)[0]))
        b = Fraction(float(words[4 + c : 5 + c].view(np.float32)[0]))
        byte = Fraction(1, 2**133)
        assert Fraction(BYTE_SCALE) == 1 / byte
        f32 = torch.tensor([_fp32(v * byte * a + b) for v in range(256)], dtype=torch.float32)
        assert torch.equal(f32.to(dtype).view(torch.int16), table[c])


def test_fp32_tables_and_opted_out_ones_claim_nothing() -> None:
    assert _header(table_rows((KIMI,), torch.float32))[0] == 0
    assert not _header(table_rows((KIMI,), torch.bfloat16, affine=False)).any()


def test_a_form_is_refused_where_a_value_leaves_the_types_range() -> None:
    # std 1e-6: the values reach 5e5, past fp16's 65504 (the table holds inf there);
    # bf16 still has the range
    mean, std = 0.5, 1e-6
    for dtype, fits in ((torch.float16, False), (torch.bfloat16, True)):
        table = shared_normalise_table((mean,) * 3, (std,) * 3, dtype).view(torch.int16).numpy()[0]
        assert (affine_form(mean, std, table, dtype) is not None) == fits


def test_a_form_whose_scaled_a_is_past_fp32_keeps_the_table() -> None:
    # std 0.1: a form exists (a = 0.039), but a 2^133 is past fp32's range, so the kernel's
    # byte (v 2^-133) cannot carry it; std 0.13 (a = 0.030) still can
    for std, claimed in ((0.1, False), (0.13, True)):
        stats = Normalisation((0.5,) * 3, (std,) * 3)
        table = normalise_table(stats, torch.bfloat16).view(torch.int16).numpy()[0]
        assert affine_form(0.5, std, table, torch.bfloat16) is not None
        assert (_header(table_rows((stats,), torch.bfloat16))[0] == 1) == claimed


def test_a_form_is_refused_where_an_operand_would_be_flushed_to_zero() -> None:
    # std 1e37: a = 1/(255 std) is an fp32 subnormal, which the GPU's FTZ build reads as 0
    # (the kernel's FMA would keep it, but a claim stays clear of subnormals)
    mean, std = 0.0, 1e37
    table = (
        shared_normalise_table((mean,) * 3, (std,) * 3, torch.bfloat16).view(torch.int16).numpy()[0]
    )
    assert affine_form(mean, std, table, torch.bfloat16) is None


def test_a_form_is_refused_where_no_candidate_matches() -> None:
    # the Kimi table shifted by one step at one byte: no fma of fp32 a, b gives it
    table = normalise_table(KIMI, torch.bfloat16).view(torch.int16).numpy()[0].copy()
    table[77] += 1
    assert affine_form(0.5, 0.5, table, torch.bfloat16) is None
    assert affine_form(0.5, 0.0, table, torch.bfloat16) is None  # no deviation, no form


def test_each_table_of_a_launch_gets_its_own_header() -> None:
    rows = table_rows((KIMI, CLIP), torch.bfloat16)
    assert rows.shape == (2, NORM_STRIDE)
    assert not np.array_equal(_header(rows, 0), _header(rows, 1))
    assert _header(rows, 0)[0] == _header(rows, 1)[0] == 1
