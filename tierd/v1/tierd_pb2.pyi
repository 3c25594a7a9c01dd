from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_REMOTE: Tier

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_size", "dtype", "block_size", "tp_rank", "tp_size", "kv_format", "model_id")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    tp_rank: int
    tp_size: int
    kv_format: str
    model_id: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., kv_format: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class SlotGeometry(_message.Message):
    __slots__ = ("slab_bytes", "slot_bytes", "slots_per_slab")
    SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_SLAB_FIELD_NUMBER: _ClassVar[int]
    slab_bytes: int
    slot_bytes: int
    slots_per_slab: int
    def __init__(self, slab_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slots_per_slab: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("layout", "engine_name")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    engine_name: str
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., engine_name: _Optional[str] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "arena_name", "arena_directory", "arena_bytes", "geometry", "lease_seconds", "max_blocks_per_request", "presence_name", "namespace")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    ARENA_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    arena_name: str
    arena_directory: str
    arena_bytes: int
    geometry: SlotGeometry
    lease_seconds: float
    max_blocks_per_request: int
    presence_name: str
    namespace: bytes
    def __init__(self, engine_id: _Optional[str] = ..., arena_name: _Optional[str] = ..., arena_directory: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., geometry: _Optional[_Union[SlotGeometry, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., max_blocks_per_request: _Optional[int] = ..., presence_name: _Optional[str] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("engine_id", "block_hashes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("engine_id", "block_hashes", "hold")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hold: bool
    def __init__(self, engine_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hold: _Optional[bool] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "seconds_left", "slot_ids", "checksums")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seconds_left: float
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., seconds_left: _Optional[float] = ..., slot_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("engine_id", "block_hashes", "hold")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    hold: bool
    def __init__(self, engine_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., hold: _Optional[bool] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("lease_id", "seconds_left", "slot_ids", "checksums", "held_after")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HELD_AFTER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seconds_left: float
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    held_after: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, lease_id: _Optional[str] = ..., seconds_left: _Optional[float] = ..., slot_ids: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., held_after: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id", "corrupt_from", "served")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FROM_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    corrupt_from: int
    served: int
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., corrupt_from: _Optional[int] = ..., served: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("engine_id", "block_hashes", "filtered_query_tokens", "blank_slots")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FILTERED_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLANK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    filtered_query_tokens: int
    blank_slots: int
    def __init__(self, engine_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., filtered_query_tokens: _Optional[int] = ..., blank_slots: _Optional[int] = ...) -> None: ...

class ReservedSlot(_message.Message):
    __slots__ = ("slot_id", "already_stored")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    already_stored: bool
    def __init__(self, slot_id: _Optional[int] = ..., already_stored: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "seconds_left", "slots")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seconds_left: float
    slots: _containers.RepeatedCompositeFieldContainer[ReservedSlot]
    def __init__(self, lease_id: _Optional[str] = ..., seconds_left: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[ReservedSlot, _Mapping]]] = ...) -> None: ...

class CommittedBlock(_message.Message):
    __slots__ = ("checksum",)
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: int
    def __init__(self, checksum: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id", "blocks", "written", "block_hashes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[CommittedBlock]
    written: _containers.RepeatedScalarFieldContainer[bool]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CommittedBlock, _Mapping]]] = ..., written: _Optional[_Iterable[bool]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class CommitManyRequest(_message.Message):
    __slots__ = ("engine_id", "commits")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    commits: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    def __init__(self, engine_id: _Optional[str] = ..., commits: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ...) -> None: ...

class CommitOutcome(_message.Message):
    __slots__ = ("stored", "code", "message")
    STORED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    code: int
    message: str
    def __init__(self, stored: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CommitManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[CommitOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[CommitOutcome, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("engine_id", "lease_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    lease_id: str
    def __init__(self, engine_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportHotBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "stored", "removed", "cleared", "prefill_tokens_per_second")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    prefill_tokens_per_second: float
    def __init__(self, engine_id: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ..., prefill_tokens_per_second: _Optional[float] = ...) -> None: ...

class ReportHotBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_blocks", "capacity_blocks", "used_bytes", "capacity_bytes", "pinned_blocks", "query_tokens", "hit_tokens", "evictions", "demotions", "promotions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_blocks: int
    capacity_blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    demotions: int
    promotions: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ...) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("model_id", "dram_blocks", "dram_bytes", "ssd_blocks", "ssd_bytes", "hbm_blocks", "query_tokens", "hit_tokens", "engines", "hbm_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    HBM_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dram_blocks: int
    dram_bytes: int
    ssd_blocks: int
    ssd_bytes: int
    hbm_blocks: int
    query_tokens: int
    hit_tokens: int
    engines: int
    hbm_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., dram_blocks: _Optional[int] = ..., dram_bytes: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., hbm_blocks: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., engines: _Optional[int] = ..., hbm_bytes: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "engine_name", "hbm_blocks", "block_size", "block_bytes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_name: str
    hbm_blocks: int
    block_size: int
    block_bytes: int
    def __init__(self, engine_id: _Optional[str] = ..., engine_name: _Optional[str] = ..., hbm_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "dram_bytes", "dram_quota_bytes", "ssd_bytes", "ssd_quota_bytes", "pinned_bytes", "reserved_bytes", "blank_bytes", "limited_requests")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    dram_bytes: int
    dram_quota_bytes: int
    ssd_bytes: int
    ssd_quota_bytes: int
    pinned_bytes: int
    reserved_bytes: int
    blank_bytes: int
    limited_requests: int
    def __init__(self, tenant: _Optional[str] = ..., dram_bytes: _Optional[int] = ..., dram_quota_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., ssd_quota_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., blank_bytes: _Optional[int] = ..., limited_requests: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "engines", "query_tokens", "hit_tokens", "hit_ratio", "reading", "checksum_failures", "lease_expiries", "ssd_healthy", "reuse_gap_p90_seconds", "idle_before_evict_p50_seconds", "models", "tenants", "savings", "what_if")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    READING_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    SSD_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REUSE_GAP_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BEFORE_EVICT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SAVINGS_FIELD_NUMBER: _ClassVar[int]
    WHAT_IF_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    query_tokens: int
    hit_tokens: int
    hit_ratio: float
    reading: str
    checksum_failures: int
    lease_expiries: int
    ssd_healthy: bool
    reuse_gap_p90_seconds: float
    idle_before_evict_p50_seconds: float
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    savings: _containers.RepeatedCompositeFieldContainer[SavingsStats]
    what_if: _containers.RepeatedCompositeFieldContainer[WhatIfCurve]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., reading: _Optional[str] = ..., checksum_failures: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., ssd_healthy: _Optional[bool] = ..., reuse_gap_p90_seconds: _Optional[float] = ..., idle_before_evict_p50_seconds: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., savings: _Optional[_Iterable[_Union[SavingsStats, _Mapping]]] = ..., what_if: _Optional[_Iterable[_Union[WhatIfCurve, _Mapping]]] = ...) -> None: ...

class WhatIfCurve(_message.Message):
    __slots__ = ("tier", "tenant", "model_id", "capacity_blocks", "scales", "hit_ratios", "flattens_at_scale", "references")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIOS_FIELD_NUMBER: _ClassVar[int]
    FLATTENS_AT_SCALE_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    tenant: str
    model_id: str
    capacity_blocks: int
    scales: _containers.RepeatedScalarFieldContainer[float]
    hit_ratios: _containers.RepeatedScalarFieldContainer[float]
    flattens_at_scale: float
    references: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., scales: _Optional[_Iterable[float]] = ..., hit_ratios: _Optional[_Iterable[float]] = ..., flattens_at_scale: _Optional[float] = ..., references: _Optional[float] = ...) -> None: ...

class SavingsStats(_message.Message):
    __slots__ = ("tenant", "model_id", "tier", "tokens", "seconds", "prefill_tokens_per_second", "speed_reported")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SPEED_REPORTED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    tier: Tier
    tokens: int
    seconds: float
    prefill_tokens_per_second: float
    speed_reported: bool
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., prefill_tokens_per_second: _Optional[float] = ..., speed_reported: _Optional[bool] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("engine_id", "block_hashes", "layout")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: Layout
    def __init__(self, engine_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class NodePlacement(_message.Message):
    __slots__ = ("node_id", "address", "prefix_blocks", "tiers", "score", "capacity_bytes", "heartbeat_age_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    prefix_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    score: float
    capacity_bytes: int
    heartbeat_age_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., prefix_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., score: _Optional[float] = ..., capacity_bytes: _Optional[int] = ..., heartbeat_age_seconds: _Optional[float] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("nodes", "stale")
    NODES_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodePlacement]
    stale: bool
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodePlacement, _Mapping]]] = ..., stale: _Optional[bool] = ...) -> None: ...

class ChainVariant(_message.Message):
    __slots__ = ("differs", "block_size", "block_hashes")
    DIFFERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    differs: str
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, differs: _Optional[str] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WhyRequest(_message.Message):
    __slots__ = ("layout", "block_hashes", "variants")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    variants: _containers.RepeatedCompositeFieldContainer[ChainVariant]
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., variants: _Optional[_Iterable[_Union[ChainVariant, _Mapping]]] = ...) -> None: ...

class BlockPlace(_message.Message):
    __slots__ = ("hbm_engines", "dram", "ssd")
    HBM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    DRAM_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    hbm_engines: _containers.RepeatedScalarFieldContainer[str]
    dram: bool
    ssd: bool
    def __init__(self, hbm_engines: _Optional[_Iterable[str]] = ..., dram: _Optional[bool] = ..., ssd: _Optional[bool] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("seconds_ago", "idle_seconds", "tier", "pressure", "cause")
    SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    seconds_ago: float
    idle_seconds: float
    tier: Tier
    pressure: str
    cause: str
    def __init__(self, seconds_ago: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ..., pressure: _Optional[str] = ..., cause: _Optional[str] = ...) -> None: ...

class HeldElsewhere(_message.Message):
    __slots__ = ("model_id", "differs", "tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DIFFERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    differs: _containers.RepeatedScalarFieldContainer[str]
    tokens: int
    def __init__(self, model_id: _Optional[str] = ..., differs: _Optional[_Iterable[str]] = ..., tokens: _Optional[int] = ...) -> None: ...

class WhyResponse(_message.Message):
    __slots__ = ("blocks", "first_miss", "evicted", "elsewhere", "namespace_blocks", "engines", "ssd_min_hits", "cluster", "nodes", "cluster_stale")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_MISS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SSD_MIN_HITS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_STALE_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockPlace]
    first_miss: int
    evicted: Eviction
    elsewhere: _containers.RepeatedCompositeFieldContainer[HeldElsewhere]
    namespace_blocks: int
    engines: int
    ssd_min_hits: int
    cluster: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodePlacement]
    cluster_stale: bool
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockPlace, _Mapping]]] = ..., first_miss: _Optional[int] = ..., evicted: _Optional[_Union[Eviction, _Mapping]] = ..., elsewhere: _Optional[_Iterable[_Union[HeldElsewhere, _Mapping]]] = ..., namespace_blocks: _Optional[int] = ..., engines: _Optional[int] = ..., ssd_min_hits: _Optional[int] = ..., cluster: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodePlacement, _Mapping]]] = ..., cluster_stale: _Optional[bool] = ...) -> None: ...
