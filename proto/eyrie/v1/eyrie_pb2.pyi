from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos", "stop", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "allowed_token_ids", "top_logprobs", "json_schema", "resumed_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    json_schema: str
    resumed_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "return_logprobs", "n", "best_of")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    return_logprobs: bool
    n: int
    best_of: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("verify_steps", "accepted_drafts", "accept_length", "accept_rate", "draft_time_s", "verify_time_s")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    accepted_drafts: int
    accept_length: float
    accept_rate: float
    draft_time_s: float
    verify_time_s: float
    def __init__(self, verify_steps: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., accept_length: _Optional[float] = ..., accept_rate: _Optional[float] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage", "spec", "ttft_s", "latency_s", "stop_str")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    reason: str
    usage: Usage
    spec: SpecStats
    ttft_s: float
    latency_s: float
    stop_str: str
    def __init__(self, reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., ttft_s: _Optional[float] = ..., latency_s: _Optional[float] = ..., stop_str: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish", "top_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish: Finish
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "sender_stopped", "resend_as_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_STOPPED_FIELD_NUMBER: _ClassVar[int]
    RESEND_AS_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_stopped: bool
    resend_as_bytes: bool
    def __init__(self, request_id: _Optional[str] = ..., sender_stopped: _Optional[bool] = ..., resend_as_bytes: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecConfig(_message.Message):
    __slots__ = ("draft_kind", "topk", "steps", "num_draft_tokens")
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_kind: str
    topk: int
    steps: int
    num_draft_tokens: int
    def __init__(self, draft_kind: _Optional[str] = ..., topk: _Optional[int] = ..., steps: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "dtype", "page_size", "spec", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    dtype: str
    page_size: int
    spec: SpecConfig
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., spec: _Optional[_Union[SpecConfig, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheShape(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class HandoffSchema(_message.Message):
    __slots__ = ("version", "page_size", "dtype", "caches", "spec", "draft_hidden_width", "vocab_size")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: int
    page_size: int
    dtype: str
    caches: _containers.RepeatedCompositeFieldContainer[CacheShape]
    spec: SpecConfig
    draft_hidden_width: int
    vocab_size: int
    def __init__(self, version: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., caches: _Optional[_Iterable[_Union[CacheShape, _Mapping]]] = ..., spec: _Optional[_Union[SpecConfig, _Mapping]] = ..., draft_hidden_width: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "decode_address", "resume_ids", "resume_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_address: str
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., resume_ids: _Optional[_Iterable[int]] = ..., resume_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "finish_reason", "top_logprobs", "decode_reserved")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RESERVED_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    finish_reason: str
    top_logprobs: TopLogprobs
    decode_reserved: bool
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., decode_reserved: _Optional[bool] = ...) -> None: ...

class HandedOff(_message.Message):
    __slots__ = ("bytes", "seconds", "chunks", "cached_tokens")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    chunks: int
    cached_tokens: int
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., chunks: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "handed_off")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    handed_off: HandedOff
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., handed_off: _Optional[_Union[HandedOff, _Mapping]] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("messages", "errors")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RelayError]
    def __init__(self, messages: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RelayError, _Mapping]]] = ...) -> None: ...

class RelayError(_message.Message):
    __slots__ = ("request_id", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    details: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("instance_id", "host_id", "transports", "pools", "nixl")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    host_id: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    pools: bytes
    nixl: bytes
    def __init__(self, instance_id: _Optional[str] = ..., host_id: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., pools: _Optional[bytes] = ..., nixl: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "output_ids", "output_logprobs", "sampling", "committed_len", "schema", "in_place", "skip_cached")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    SKIP_CACHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampling: SamplingParams
    committed_len: int
    schema: HandoffSchema
    in_place: bool
    skip_cached: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., committed_len: _Optional[int] = ..., schema: _Optional[_Union[HandoffSchema, _Mapping]] = ..., in_place: _Optional[bool] = ..., skip_cached: _Optional[bool] = ...) -> None: ...

class PageList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted", "reason", "pages", "write_deadline", "cached_pages")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    pages: _containers.RepeatedCompositeFieldContainer[PageList]
    write_deadline: float
    cached_pages: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., pages: _Optional[_Iterable[_Union[PageList, _Mapping]]] = ..., write_deadline: _Optional[float] = ..., cached_pages: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "cache", "layer", "first_page", "num_pages", "k", "v", "crc32", "draft_state", "last", "total_chunks", "seq", "in_place", "in_place_bytes", "output_ids", "output_logprobs", "stream", "streams")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cache: int
    layer: int
    first_page: int
    num_pages: int
    k: bytes
    v: bytes
    crc32: int
    draft_state: bytes
    last: bool
    total_chunks: int
    seq: int
    in_place: bool
    in_place_bytes: int
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    stream: int
    streams: int
    def __init__(self, request_id: _Optional[str] = ..., cache: _Optional[int] = ..., layer: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., crc32: _Optional[int] = ..., draft_state: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_chunks: _Optional[int] = ..., seq: _Optional[int] = ..., in_place: _Optional[bool] = ..., in_place_bytes: _Optional[int] = ..., output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., stream: _Optional[int] = ..., streams: _Optional[int] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("bytes", "chunks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    chunks: int
    def __init__(self, bytes: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...
