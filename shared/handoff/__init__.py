"""The prefill -> decode hand-off: the schema both sides agree on (``schema``), the KV wire format
(``wire``: page-aligned, checksummed, coalesced chunks), and the transports that carry it
(``transport``: the ``Transport`` interface, the same-host ``ipc`` transport over ``ipc``'s mapped pools (a
peer GPU's through ``peer``), the gRPC stream for any network, and ``nixl``'s, chosen per decode instance at the
handshake).

A request's hand-off carries its target KV pages (all layers), its draft KV pages (every draft cache,
all layers) and its ``shared.spec.state.DraftState``; the decode side reserves the pages first and
acknowledges, and the prefill side frees its copy only after the acknowledgement.
"""

from __future__ import annotations

from proto.eyrie.v1 import eyrie_pb2 as pb
from shared.handoff.schema import SCHEMA_VERSION, CacheShape, HandoffSchema, SchemaMismatch
from shared.handoff.transport import (
    TRANSPORTS,
    ChannelPool,
    DecodeClient,
    GrpcStreamTransport,
    IpcTransport,
    NixlTransport,
    Transport,
    negotiate,
)
from shared.handoff.wire import (
    Increment,
    InPlaceTarget,
    PageFeed,
    PageGuard,
    PageRun,
    PageSink,
    PageSource,
    Prefilled,
    Received,
    TransferCancelled,
    TransferError,
    TransportFailed,
    coalesce,
    decode_draft_state,
    encode_draft_state,
    iter_chunks,
    plan_slices,
)


def top_logprobs_pb(pairs: list[tuple[int, float]]) -> pb.TopLogprobs:
    """One token's (token id, log p) alternatives -> the wire message."""
    return pb.TopLogprobs(token_ids=[t for t, _ in pairs], logprobs=[lp for _, lp in pairs])


def sampling_to_pb(params) -> pb.SamplingParams:
    """``shared.sampling.SamplingParams`` -> the wire message."""
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            max_new_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                            ignore_eos=params.ignore_eos, stop=list(params.stop),
                            include_stop_str_in_output=params.include_stop_str_in_output,
                            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                            repetition_penalty=params.repetition_penalty, min_p=params.min_p,
                            min_tokens=params.min_tokens, logit_bias=dict(params.logit_bias),
                            allowed_token_ids=list(params.allowed_token_ids), top_logprobs=params.top_logprobs,
                            resumed_tokens=params.resumed_tokens)
    if params.seed is not None:
        msg.seed = params.seed
    if params.json_schema is not None:
        msg.json_schema = params.json_schema
    return msg


def sampling_from_pb(msg: pb.SamplingParams, default_max_new_tokens: int = 16):
    """SamplingParams from the wire (0 / unset fields take their defaults); raises pydantic errors."""
    from shared.sampling import SamplingParams

    return SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, stop=tuple(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, min_p=msg.min_p, min_tokens=msg.min_tokens,
        logit_bias=tuple(sorted(msg.logit_bias.items())), allowed_token_ids=tuple(msg.allowed_token_ids),
        top_logprobs=msg.top_logprobs, json_schema=msg.json_schema if msg.HasField("json_schema") else None,
        resumed_tokens=msg.resumed_tokens,
    )


__all__ = [
    "SCHEMA_VERSION", "TRANSPORTS", "CacheShape", "ChannelPool", "DecodeClient", "GrpcStreamTransport",
    "HandoffSchema", "InPlaceTarget", "Increment", "IpcTransport", "NixlTransport", "PageFeed", "PageGuard",
    "PageRun", "PageSink", "PageSource", "Prefilled", "Received",
    "SchemaMismatch", "TransferCancelled",
    "TransferError", "Transport", "TransportFailed", "coalesce", "decode_draft_state", "encode_draft_state",
    "iter_chunks", "negotiate", "plan_slices", "sampling_from_pb", "sampling_to_pb", "top_logprobs_pb",
]
