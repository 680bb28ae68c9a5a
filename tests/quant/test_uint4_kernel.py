"""The seam's `convert_from_uint4` kernel on both backends (`hpu_backend`) against a
straightforward per-element reference: W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], with q and z
read nibble by nibble from int32 words packed along N in plain order (nibble i of word j is column
8j+i). Exact: the kernel rounds once, like the reference."""

from __future__ import annotations

import pytest
import torch

from tests.quant.packers import pack_along_last


def reference(qweight, scales, qzeros, g_idx):
    rows, cols = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(rows, cols, dtype=torch.float32)
    for k in range(rows):
        g = int(g_idx[k])
        for n in range(cols):
            q = (int(qweight[k, n // 8]) >> (4 * (n % 8))) & 0xF
            z = (int(qzeros[g, n // 8]) >> (4 * (n % 8))) & 0xF
            out[k, n] = (q - z) * float(scales[g, n])
    return out


def random_case(rows=32, cols=16, groups=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=gen)
    z = torch.randint(0, 16, (groups, cols), generator=gen)
    scales = torch.rand(groups, cols, generator=gen) + 0.01
    return pack_along_last(q), scales, pack_along_last(z)


def test_grouped_rows_dequantize_like_the_reference(hpu_backend):
    qweight, scales, qzeros = random_case()
    out = hpu_backend.convert_from_uint4(qweight, scales, qzeros, torch.float32)
    g_idx = torch.arange(32) // 8
    torch.testing.assert_close(out, reference(qweight, scales, qzeros, g_idx), rtol=0, atol=0)


def test_words_with_the_top_bit_set_unpack_unsigned(hpu_backend):
    # Nibble 7 >= 8 makes the int32 word negative: it must still read as 8..15.
    qweight = torch.full((8, 1), -1, dtype=torch.int32)  # every nibble 15
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    out = hpu_backend.convert_from_uint4(qweight, torch.ones(1, 8), qzeros, torch.float32)
    assert torch.equal(out, torch.full((8, 8), 15.0))


def test_g_idx_picks_each_rows_group(hpu_backend):
    qweight, scales, qzeros = random_case(seed=1)
    g_idx = torch.randperm(32, generator=torch.Generator().manual_seed(2)) % 4
    out = hpu_backend.convert_from_uint4(
        qweight, scales, qzeros, torch.float32, g_idx.to(torch.int32)
    )
    torch.testing.assert_close(out, reference(qweight, scales, qzeros, g_idx), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_is_the_reference_rounded_once_to_out_dtype(hpu_backend, dtype):
    qweight, scales, qzeros = random_case(seed=3)
    out = hpu_backend.convert_from_uint4(qweight, scales, qzeros, dtype)
    assert out.dtype == dtype and out.shape == (32, 16)
    expected = reference(qweight, scales, qzeros, torch.arange(32) // 8).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
