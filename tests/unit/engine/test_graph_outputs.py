"""One output buffer per captured phase (``shared.cuda_graphs.SharedOutputs``): every batch size's graph copies
its outputs into the first rows of one buffer sized for the largest bucket, so a phase keeps one set of outputs,
not one per batch size. The copy itself runs inside the graph (``tests/gpu/test_graph_outputs_gpu.py``); here the
buffers' sizing and binding on plain tensors."""

import dataclasses

import torch

from shared.cuda_graphs import SharedOutputs


@dataclasses.dataclass
class Out:
    logits: torch.Tensor  # [bs * N, V]: scales with the batch
    count: torch.Tensor  # a scalar: does not


def outputs(bs: int, fill: float) -> Out:
    return Out(logits=torch.full((bs * 4, 10), fill), count=torch.tensor(bs))


def test_the_buffers_hold_the_largest_bucket_and_each_batch_size_writes_their_first_rows():
    shared = SharedOutputs()
    shared.allocate(outputs(2, 0.0), bs=2, max_bs=16)
    shared.buffers[0].zero_()
    logits, scalar = shared.buffers
    assert logits.shape == (64, 10) and scalar is None  # 16 requests x 4 rows; the scalar keeps its own
    small, large = shared.bind(outputs(2, 1.0)), shared.bind(outputs(8, 2.0))
    assert small.logits.data_ptr() == large.logits.data_ptr() == logits.data_ptr()  # one storage
    assert large.logits.shape == (32, 10) and torch.equal(large.logits, torch.full((32, 10), 2.0))
    assert torch.equal(logits[32:], torch.zeros(32, 10))  # rows past bs 8's untouched
    assert small.count.item() == 2 and large.count.item() == 8  # not bound: the graph's own tensors


def test_a_later_size_with_another_shape_or_dtype_or_too_many_rows_keeps_its_own_output():
    shared = SharedOutputs()
    shared.allocate(outputs(1, 0.0), bs=1, max_bs=4)
    buffer = shared.buffers[0]
    wide = shared.bind(Out(logits=torch.ones(4, 11), count=torch.tensor(1)))
    half = shared.bind(Out(logits=torch.ones(4, 10, dtype=torch.float16), count=torch.tensor(1)))
    many = shared.bind(Out(logits=torch.ones(20, 10), count=torch.tensor(5)))
    for out in (wide, half, many):
        assert out.logits.data_ptr() != buffer.data_ptr()
    assert shared.bind(outputs(4, 3.0)).logits.data_ptr() == buffer.data_ptr()


def test_allocation_happens_once_from_the_first_capture():
    shared = SharedOutputs()
    shared.allocate(outputs(1, 0.0), bs=1, max_bs=8)
    first = shared.buffers[0]
    shared.allocate(outputs(2, 0.0), bs=2, max_bs=8)
    assert shared.buffers[0] is first
