"""A mixed step (prefill chunks beside decode rows) runs its decode rows through the decode launch and its chunks
through the extend kernel (``kernels.mixed_attention``): a decode row gets the bits a decode step gives it, a chunk
the bits a prefill step of its own gives it, and the whole is the reference's.

Runs both kernels under TRITON_INTERPRET=1 on the CPU (conftest sets it) with tiny shapes: 2 KV heads x 4 query
heads of 16, so a request of up to 16 queries is decode-like (``q_len * group <= DECODE_ROWS``); keys split every
32 positions. tests/gpu/test_mixed_attention_gpu.py checks the same on CUDA at the 8B shape.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE

from kernels.attention_ref import AttentionMetadata
from kernels.mixed_attention import mixed_attention, split_mixed
from shared.model.layers import EXTEND_MIN_Q
from tests.mixed_attention_checks import check_mixed, meta_of, mixed_case


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_rows_first_are_sliced_and_equal_a_decode_step(page_size):
    """The engine's order (decode rows, then the chunks): both sides are runs of rows, sliced as views; decode
    rows whose contexts end just before, at and past a split bound."""
    q_lens, prefixes = [1, 1, 1, EXTEND_MIN_Q + 6], [31, 64, 90, 20]
    split, _ = check_mixed(mixed_case(q_lens, prefixes, page_size, DEVICE, seed=page_size), [0, 1, 2])
    assert split.decode.rows == slice(0, 3) and split.extend.rows == slice(3, 3 + EXTEND_MIN_Q + 6)
    assert split.decode.meta.prefix_lens_cpu == [31, 64, 90] and split.extend.meta.prefix_lens_cpu == [20]


def test_interleaved_requests_are_gathered_and_scattered():
    """Another order (a decode row, a chunk, a short chunk, a second chunk, a decode row): both sides gathered and
    scattered by row index. The short chunk (12 queries x 4 heads fit one 64-row tile) goes with the decode rows."""
    q_lens, prefixes = [1, EXTEND_MIN_Q, 12, 80, 1], [45, 0, 7, 16, 33]
    case = mixed_case(q_lens, prefixes, 4, DEVICE, seed=7)
    split, _ = check_mixed(case, [0, 2, 4])
    assert torch.equal(split.decode.rows, case.rows([0, 2, 4])) and torch.equal(split.extend.rows, case.rows([1, 3]))


def test_bfloat16_mixed_step():
    check_mixed(mixed_case([1, 1, EXTEND_MIN_Q + 3], [50, 17, 40], 16, DEVICE, torch.bfloat16, seed=3), [0, 1])


def test_sliding_window_mixed_step():
    """A window shorter than the contexts: the decode launch and the extend kernel each drop the same keys."""
    case = mixed_case([1, 1, EXTEND_MIN_Q + 2], [70, 12, 30], 4, DEVICE, seed=5)
    check_mixed(case, [0, 1], window=24)


def test_nothing_to_split():
    """Every request on one side, a custom mask, or no host copies of the metadata (reading the device would
    wait for it): the batch runs as one launch (None)."""
    case = mixed_case([1, EXTEND_MIN_Q], [9, 0], 1, "cpu")
    assert split_mixed(case.meta, 4) is not None
    assert split_mixed(meta_of(case.slots[:1], [1], [9], "cpu", 32), 4) is None
    assert split_mixed(meta_of(case.slots[1:], [EXTEND_MIN_Q], [0], "cpu", 32), 4) is None
    m = case.meta
    no_host = AttentionMetadata(m.qo_indptr, m.kv_indptr, m.kv_indices, m.prefix_lens, max_q_len=m.max_q_len)
    assert split_mixed(no_host, 4) is None
    masked = meta_of(case.slots, [1, EXTEND_MIN_Q], [9, 0], "cpu", 32)
    masked.custom_mask = torch.ones(1 + EXTEND_MIN_Q * EXTEND_MIN_Q, dtype=torch.bool)
    assert split_mixed(masked, 4) is None


def test_an_empty_request_goes_to_the_extend_side():
    """A request with no query rows is not a decode row: a batch of one and a long one does not split."""
    case = mixed_case([0, 1, EXTEND_MIN_Q], [5, 9, 0], 1, "cpu")
    split = split_mixed(case.meta, 4)
    assert split.decode.meta.prefix_lens_cpu == [9] and split.extend.meta.prefix_lens_cpu == [5, 0]
    case = mixed_case([0, EXTEND_MIN_Q], [5, 0], 1, "cpu")
    assert split_mixed(case.meta, 4) is None


@pytest.mark.parametrize("decode_rows", [1, 2, 3])
@pytest.mark.parametrize("chunks", [1, 2])
def test_every_index_tensor_of_a_split_starts_in_line(decode_rows, chunks):
    """Triton specialises a pointer argument on 16-byte alignment: a part's index tensors sliced from wherever the
    batch's other requests end compiled the kernels again as the counts of decode rows and chunks changed parity
    (mid-serve). Each starts 16 bytes in line, whatever the counts, and holds its requests' values."""
    slots = [[3 + b, 40 + b, 80 + b] for b in range(decode_rows)] + [list(range(100 * c, 100 * c + 70))
                                                                      for c in range(1, chunks + 1)]
    q_lens = [1] * decode_rows + [EXTEND_MIN_Q + 10] * chunks
    prefixes = [len(s) - n for s, n in zip(slots, q_lens)]
    split = split_mixed(meta_of(slots, q_lens, prefixes, DEVICE, 32), 4)
    for part, reqs in ((split.decode, range(decode_rows)), (split.extend, range(decode_rows, len(slots)))):
        m = part.meta
        for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.prefix_lens):
            assert t.data_ptr() % 16 == 0
        assert m.kv_indices.tolist() == [x for b in reqs for x in slots[b]]
        assert m.kv_indptr.tolist() == m.kv_indptr_cpu and m.qo_indptr.tolist() == m.qo_indptr_cpu
        assert m.prefix_lens.tolist() == [prefixes[b] for b in reqs]


def test_a_destination_of_another_shape_is_refused():
    case = mixed_case([1, EXTEND_MIN_Q], [9, 0], 1, "cpu")
    split = split_mixed(case.meta, 4)
    with pytest.raises(ValueError, match="out must be"):
        mixed_attention(case.q, case.pool.k, case.pool.v, case.loc, split, 0.5, out=case.q[:-1].clone())
