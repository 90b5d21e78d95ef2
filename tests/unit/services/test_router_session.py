"""A session hands the client everything that arrived since its last write as one message: tokens, logprobs,
top logprobs and text in order, the last message's finish."""

from __future__ import annotations

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.router.session import merge


def test_merged_messages_keep_every_token_in_order_and_the_last_finish():
    a = pb.GenerateResponse(request_id="r", token_ids=[1, 2], logprobs=[-0.5, -0.25], text="ab",
                            top_logprobs=[pb.TopLogprobs(token_ids=[1], logprobs=[-0.1])] * 2)
    b = pb.GenerateResponse(request_id="r", token_ids=[3], logprobs=[-0.75], text="c",
                            top_logprobs=[pb.TopLogprobs(token_ids=[3], logprobs=[-0.3])])
    c = pb.GenerateResponse(request_id="r", token_ids=[4], logprobs=[-1.5], text="",
                            finish=pb.Finish(reason="length", usage=pb.Usage(completion_tokens=4)))
    out = merge([a, b, c])
    assert list(out.token_ids) == [1, 2, 3, 4] and list(out.logprobs) == [-0.5, -0.25, -0.75, -1.5]
    assert out.text == "abc" and [list(t.token_ids) for t in out.top_logprobs] == [[1], [1], [3]]
    assert out.finish.reason == "length" and out.finish.usage.completion_tokens == 4
    assert not merge([a, b]).HasField("finish") and merge([b]) is b
