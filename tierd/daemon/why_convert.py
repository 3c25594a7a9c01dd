"""Protobuf conversion of ``tierd why``'s question and answer (``Why`` RPC), both sides.

The answer travels as ``tierd.daemon.why``'s own dataclasses: the client gets back exactly what
the daemon's ``Explainer`` produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.daemon.ghosts import PRESSURES
from tierd.daemon.why import BlockWhere, Elsewhere, Evicted, Variant, WhyAnswer
from tierd.types import BlockHash
from tierd.v1 import tierd_pb2 as pb
from tierd.wire.convert import (
    TIER_TO_PB,
    hashes_from_pb,
    layout_from_pb,
    layout_to_pb,
    locate_to_pb,
    located_from_pb,
    tiers_from_pb,
)
from tierd.wire.layout import Layout


def request_to_pb(layout: Layout, hashes: Sequence[BlockHash],
                  variants: Sequence[Variant]) -> pb.WhyRequest:
    return pb.WhyRequest(layout=layout_to_pb(layout), block_hashes=hashes, variants=[
        pb.ChainVariant(differs=v.differs, block_size=v.block_size, block_hashes=v.hashes)
        for v in variants])


def request_from_pb(msg: pb.WhyRequest) -> tuple[Layout, list[BlockHash], list[Variant]]:
    """The layout, chain and variants of a question; ValueError naming a bad field."""
    if not msg.HasField("layout"):
        raise ValueError("Why needs the engine layout (the namespace to explain)")
    return (layout_from_pb(msg.layout), hashes_from_pb(msg.block_hashes),
            [Variant(v.differs[:256], v.block_size, hashes_from_pb(v.block_hashes))
             for v in msg.variants])


def answer_to_pb(answer: WhyAnswer) -> pb.WhyResponse:
    msg = pb.WhyResponse(
        blocks=[pb.BlockPlace(hbm_engines=b.hbm_engines, dram=b.dram, ssd=b.ssd)
                for b in answer.blocks],
        first_miss=answer.first_miss,
        elsewhere=[pb.HeldElsewhere(model_id=e.model_id, differs=e.differs, tokens=e.tokens)
                   for e in answer.elsewhere],
        namespace_blocks=answer.namespace_blocks, engines=answer.engines,
        ssd_min_hits=answer.ssd_min_hits, cluster=answer.cluster,
        nodes=locate_to_pb(answer.nodes, answer.cluster_stale).nodes,
        cluster_stale=answer.cluster_stale)
    if answer.evicted is not None:
        e = answer.evicted
        msg.evicted.CopyFrom(pb.Eviction(seconds_ago=e.seconds_ago, idle_seconds=e.idle_seconds,
                                         tier=TIER_TO_PB[e.tier], pressure=e.pressure,
                                         cause=e.cause))
    return msg


def answer_from_pb(msg: pb.WhyResponse) -> WhyAnswer:
    evicted = None
    if msg.HasField("evicted"):
        e = msg.evicted
        if e.pressure not in PRESSURES:
            raise ValueError(f"unknown eviction pressure {e.pressure!r}: upgrade tierd")
        evicted = Evicted(e.seconds_ago, e.idle_seconds, tiers_from_pb([e.tier])[0],
                          e.pressure)
    return WhyAnswer(
        blocks=[BlockWhere(tuple(b.hbm_engines), b.dram, b.ssd) for b in msg.blocks],
        first_miss=msg.first_miss, evicted=evicted,
        elsewhere=[Elsewhere(e.model_id, tuple(e.differs), e.tokens) for e in msg.elsewhere],
        namespace_blocks=msg.namespace_blocks, engines=msg.engines,
        ssd_min_hits=msg.ssd_min_hits, cluster=msg.cluster,
        nodes=located_from_pb(pb.LocateResponse(nodes=msg.nodes)).nodes,
        cluster_stale=msg.cluster_stale)
