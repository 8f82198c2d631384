from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompatInfo(_message.Message):
    __slots__ = ("model_fingerprint", "num_layers", "num_kv_heads", "head_dim", "sparse_layers", "index_head_dim", "page_size", "kv_dtype", "index_dtype", "fp8_dtype", "model_dtype", "layout", "compat_hash")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SPARSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FP8_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sparse_layers: _containers.RepeatedScalarFieldContainer[int]
    index_head_dim: int
    page_size: int
    kv_dtype: str
    index_dtype: str
    fp8_dtype: str
    model_dtype: str
    layout: str
    compat_hash: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., sparse_layers: _Optional[_Iterable[int]] = ..., index_head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., index_dtype: _Optional[str] = ..., fp8_dtype: _Optional[str] = ..., model_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "compat", "transports")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat: CompatInfo
    transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., transports: _Optional[_Iterable[str]] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("protocol_version", "compat", "transport", "max_prompt_tokens", "max_message_bytes", "node_id", "max_in_flight", "max_deadline_s", "receiver_timeout_s", "max_image_bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat: CompatInfo
    transport: str
    max_prompt_tokens: int
    max_message_bytes: int
    node_id: str
    max_in_flight: int
    max_deadline_s: float
    receiver_timeout_s: float
    max_image_bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., transport: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., node_id: _Optional[str] = ..., max_in_flight: _Optional[int] = ..., max_deadline_s: _Optional[float] = ..., receiver_timeout_s: _Optional[float] = ..., max_image_bytes: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "has_seed", "seed", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    has_seed: bool
    seed: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "compat_hash", "sampling", "transport_port", "transfer_id", "num_cached_pages", "dst_pages", "layers_per_group", "max_message_bytes", "deadline_unix_s", "message_per_piece", "token_ids", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_PORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_PER_PIECE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    compat_hash: str
    sampling: SamplingParams
    transport_port: int
    transfer_id: int
    num_cached_pages: int
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    layers_per_group: int
    max_message_bytes: int
    deadline_unix_s: float
    message_per_piece: bool
    token_ids: bytes
    images: _containers.RepeatedCompositeFieldContainer[PromptImage]
    def __init__(self, request_id: _Optional[str] = ..., compat_hash: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., transport_port: _Optional[int] = ..., transfer_id: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., dst_pages: _Optional[_Iterable[int]] = ..., layers_per_group: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., deadline_unix_s: _Optional[float] = ..., message_per_piece: _Optional[bool] = ..., token_ids: _Optional[bytes] = ..., images: _Optional[_Iterable[_Union[PromptImage, _Mapping]]] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("offset", "num_tokens", "digest", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    num_tokens: int
    digest: bytes
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., digest: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "first_logprob", "num_prompt_tokens", "num_pages_sent", "num_messages_sent", "bytes_sent", "top_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: float
    num_prompt_tokens: int
    num_pages_sent: int
    num_messages_sent: int
    bytes_sent: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., num_pages_sent: _Optional[int] = ..., num_messages_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("was_running",)
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    def __init__(self, was_running: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("serving", "running", "waiting_tokens", "pages_free", "pages_total", "error")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    running: int
    waiting_tokens: int
    pages_free: int
    pages_total: int
    error: str
    def __init__(self, serving: _Optional[bool] = ..., running: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., pages_free: _Optional[int] = ..., pages_total: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
