"""Per-model occupancy and hits: counted apart for models of one shape, per tenant, kept across
a restart (``models.json``), exact after SSD health changes (``check_integrity`` compares)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from node_rig import BLOCK, LAYOUT, MakeRig, chain  # noqa: E402

from tierd.daemon.models import FILE_NAME

TUNED = dataclasses.replace(LAYOUT, model_id="tuned@1")


async def test_models_counted_apart_per_tenant_and_across_a_restart(make_rig: MakeRig,
                                                                    tmp_path: Path) -> None:
    """Base stores 3 blocks, a same-shape fine-tune 2 of the same chain (its own copies); both
    rows show their DRAM blocks and bytes and the base's lookups. Another tenant sees no row.
    A graceful stop writes the fine-tune's blocks (the most recent) to SSD; after the restart
    they are still attributed to it, before any engine of it registers again."""
    first = make_rig(ssd_dir=str(tmp_path / "shared"))
    tuned = first.node.register_engine("default", TUNED, "tuned")
    hashes = chain(3)
    first.store(hashes)
    assert first.tiers(hashes) == ["dram"] * 3
    assert first.node.lookup(tuned.engine_id, hashes).tiers == []
    first.store(hashes[:2], engine=tuned)
    rows = {m.model_id: m for m in first.node.models_of("default")}
    base, mine = rows[LAYOUT.model_id], rows["tuned@1"]
    assert (base.blocks["dram"], base.bytes["dram"], base.engines) == (3, 3 * BLOCK, 1)
    assert (base.query_tokens, base.hit_tokens) == (48, 48)
    assert (mine.blocks["dram"], mine.query_tokens, mine.hit_tokens) == (2, 48, 0)
    first.node.register_engine("acme", LAYOUT, "acme-engine")
    assert [m.model_id for m in first.node.models_of("acme")] == [LAYOUT.model_id]
    assert first.node.models_of("acme")[0].blocks["dram"] == 0
    first.node.check_integrity()
    await first.node.close()
    assert len(json.loads((tmp_path / "shared" / FILE_NAME).read_text())) == 3  # 2 tenants
    second = make_rig(ssd_dir=str(tmp_path / "shared"))
    rows = {m.model_id: m for m in second.node.models_of("default")}
    assert (rows["tuned@1"].blocks["ssd"], rows["tuned@1"].bytes["ssd"]) == (2, 2 * BLOCK)
    assert (rows["tuned@1"].engines, rows[LAYOUT.model_id].engines) == (0, 1)
    second.node.check_integrity()


async def test_unreadable_models_file_starts_empty(make_rig: MakeRig, tmp_path: Path) -> None:
    """A damaged models.json is ignored (logged); the node serves and counts afresh."""
    (tmp_path / "ssd2").mkdir()
    (tmp_path / "ssd2" / FILE_NAME).write_text("{not json")
    rig = make_rig(ssd_dir=str(tmp_path / "ssd2"))
    rig.store(chain(2))
    assert [m.blocks["dram"] for m in rig.node.models_of("default")] == [2]
    rig.node.check_integrity()
