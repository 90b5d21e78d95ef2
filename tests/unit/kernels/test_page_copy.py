"""The page-copy kernel (the same-host hand-off's data path) equals its torch reference: every K/V plane and
layer of exactly the listed pages is written, nothing else; the interpreter on the CPU, the kernel on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels.page_copy import copy_pages, copy_pages_ref, page_runs


def pool(slots: int, seed: int, layers: int = 3, heads: int = 2, dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, slots, heads, dim, generator=g).to(DEVICE, torch.float16)


@pytest.mark.parametrize("src_pages, dst_pages", [
    ([1, 2, 3, 4], [1, 2, 3, 4]),  # one run
    ([1, 2, 3, 4], [9, 3, 7, 1]),  # scattered on the receiving side
    ([5, 1, 6, 2], [2, 3, 4, 8]),  # scattered on the sending side
    ([3], [10]),
], ids=["one-run", "scattered-dst", "scattered-src", "single"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("block", [4096, 16], ids=["one-program-per-page", "page-split-over-programs"])
def test_kernel_equals_reference_and_writes_only_the_listed_pages(src_pages, dst_pages, page_size, block):
    src = pool(8 * page_size, seed=1)
    dst_ref = pool(12 * page_size, seed=2)  # another pool size: the planes' strides differ
    dst = dst_ref.clone()
    before = dst.clone()
    copy_pages_ref(dst_ref, src, src_pages, dst_pages, page_size)
    copy_pages(dst, src, src_pages, dst_pages, page_size, backend="triton", block=block)
    assert torch.equal(dst, dst_ref)
    for s, d in zip(src_pages, dst_pages):
        assert torch.equal(dst[:, :, d * page_size:(d + 1) * page_size], src[:, :, s * page_size:(s + 1) * page_size])
    untouched = torch.ones(dst.shape[2], dtype=torch.bool)
    for d in dst_pages:
        untouched[d * page_size:(d + 1) * page_size] = False
    assert torch.equal(dst[:, :, untouched.to(dst.device)], before[:, :, untouched.to(dst.device)])


def test_page_runs_coalesce_only_what_is_contiguous_on_both_sides():
    assert page_runs([1, 2, 3, 7], [4, 5, 9, 10]) == [(1, 4, 2), (3, 9, 1), (7, 10, 1)]
    with pytest.raises(ValueError, match="3 source pages, 2 destination pages"):
        page_runs([1, 2, 3], [1, 2])


def test_pools_of_different_shapes_are_refused_naming_them():
    with pytest.raises(ValueError, match="pools differ in shape"):
        copy_pages(pool(8, 1, heads=2), pool(8, 1, heads=4), [1], [1], 1, backend="triton")


@pytest.mark.parametrize("pages_per_program, word_bytes, flat_grid, block", [
    (2, 8, False, 4096),  # 5 pages: the last program has one
    (3, 4, True, 16),  # a page split over programs on the 2D grid
    (1, 2, True, 4096),
    (4, 1, False, 32),
])
def test_every_kernel_variant_equals_the_reference(pages_per_program, word_bytes, flat_grid, block):
    """The variants bench/tune_page_copy.py sweeps copy the same bytes: pages per program, the word width the
    bytes move in, the 2D grid."""
    src, dst_ref = pool(8 * 2, seed=1), pool(12 * 2, seed=2)
    dst = dst_ref.clone()
    src_pages, dst_pages = [5, 1, 6, 2, 7], [2, 3, 11, 8, 0]
    copy_pages_ref(dst_ref, src, src_pages, dst_pages, 2)
    from kernels.page_copy import KernelSettings

    settings = KernelSettings(pages_per_program=pages_per_program, word_bytes=word_bytes, flat_grid=flat_grid)
    copy_pages(dst, src, src_pages, dst_pages, 2, backend="triton", block=block, settings=settings)
    assert torch.equal(dst, dst_ref)


def test_bytes_move_as_the_widest_word_that_divides_a_row():
    from kernels.page_copy import as_words

    assert as_words(pool(4, 1, dim=8), 8).dtype == torch.int64  # 16-byte rows
    assert as_words(pool(4, 1, dim=6), 8).dtype == torch.int32  # 12-byte rows
    assert as_words(pool(4, 1, dim=3), 8).dtype == torch.int16
    odd = pool(4, 1, dim=8)
    assert as_words(odd, 8).data_ptr() == odd.data_ptr()  # the same memory, not a copy
