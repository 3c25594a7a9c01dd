"""Per-model occupancy and hits: counted apart for models of one shape, per tenant, kept across
a restart (``models.json``), exact after SSD health changes (``check_integrity`` compares)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import sys
import threading
from pathlib import Path

import pytest
from node_rig import BLOCK, LAYOUT, MakeRig, Rig, chain  # noqa: E402

from tierd.daemon.models import FILE_NAME
from tierd.wire.layout import namespace_for

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


def _entry(model_id: str = '"tuned@1"', block_bytes: str = "1024") -> str:
    """One models.json entry of tenant default (the JSON text: values may be raw tokens)."""
    return (f'"{namespace_for("default", TUNED).hex()}": {{"tenant": "default", '
            f'"model_id": {model_id}, "block_bytes": {block_bytes}}}')


DAMAGED = {
    "huge float": "{" + _entry(block_bytes="1e999") + "}",
    "infinity": "{" + _entry(block_bytes="Infinity") + "}",
    "negative size": "{" + _entry(block_bytes="-5") + "}",
    "float size": "{" + _entry(block_bytes="1024.0") + "}",
    "deep nesting": "[" * 100_000,
    "terminal escape": "{" + _entry(model_id='"tuned\\u001b[2J@1"') + "}",
    "bad namespace": '{"zz": {"tenant": "default", "model_id": "a@1", "block_bytes": 1}}',
    "over the cap": "{" + _entry() + "}" + " " * (4096 * 1024),
}


@pytest.mark.parametrize("case", list(DAMAGED))
async def test_damaged_models_file_is_one_warning_and_an_empty_table(
        case: str, make_rig: MakeRig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Overflowing or infinite sizes, 100,000 nested brackets, a model id with a terminal
    escape, a bad key or a file past the size cap: the node starts with an empty table (no row
    of the file's model in Stats), one WARNING names the file, and the next registration
    rewrites the file whole."""
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / FILE_NAME).write_text(DAMAGED[case])
    with caplog.at_level("WARNING", logger="tierd.daemon.models"):
        rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    warned = [r.getMessage() for r in caplog.records if r.name == "tierd.daemon.models"]
    assert len(warned) == 1 and str(tmp_path / "ssd" / FILE_NAME) in warned[0], warned
    assert "\x1b" not in warned[0]
    assert [m.model_id for m in rig.node.models_of("default")] == [LAYOUT.model_id]
    rig.node.check_integrity()
    await rig.node.close()
    body = json.loads((tmp_path / "ssd" / FILE_NAME).read_text())
    assert [m["model_id"] for m in body.values()] == [LAYOUT.model_id]


async def test_fifo_named_models_file_does_not_block_start_up(
        make_rig: MakeRig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO named models.json: start-up neither blocks on it nor reads it (one warning)."""
    (tmp_path / "ssd").mkdir()
    fifo = tmp_path / "ssd" / FILE_NAME
    os.mkfifo(fifo)
    started: list[Rig] = []
    with caplog.at_level("WARNING", logger="tierd.daemon.models"):
        opener = threading.Thread(target=lambda: started.append(
            make_rig(ssd_dir=str(tmp_path / "ssd"))))
        opener.start()
        opener.join(timeout=10)
        if opener.is_alive():  # blocked opening the FIFO: give it a writer and EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            opener.join()
            pytest.fail("start-up blocked on a FIFO named models.json")
    warned = [r.getMessage() for r in caplog.records if r.name == "tierd.daemon.models"]
    assert len(warned) == 1 and "not a regular file" in warned[0], warned
    mode = os.lstat(fifo).st_mode  # untouched until the writer thread writes the table, ...
    if not stat.S_ISFIFO(mode):  # ... which the rig's registration asks for: then it is whole
        assert stat.S_ISREG(mode)
        body = json.loads(fifo.read_text())
        assert [m["model_id"] for m in body.values()] == [LAYOUT.model_id]
    assert [m.model_id for m in started[0].node.models_of("default")] == [LAYOUT.model_id]


async def test_symlinked_temp_file_is_replaced_not_followed(make_rig: MakeRig,
                                                            tmp_path: Path) -> None:
    """A symlink planted as models.json.new is removed, never written through: its target keeps
    its bytes, and models.json is a regular file of mode 0600."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / (FILE_NAME + ".new")).symlink_to(victim)
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    await rig.node.close()
    assert victim.read_text() == "precious"
    st = os.lstat(tmp_path / "ssd" / FILE_NAME)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert not os.path.lexists(tmp_path / "ssd" / (FILE_NAME + ".new"))
    body = json.loads((tmp_path / "ssd" / FILE_NAME).read_text())
    assert [m["model_id"] for m in body.values()] == [LAYOUT.model_id]


async def test_daemon_locked_out_of_the_ssd_directory_writes_no_models_file(
        make_rig: MakeRig, tmp_path: Path) -> None:
    """A second node on a directory the first holds locked registers engines of its own; the
    file is the first node's alone (no entry of the second's, no temp file left)."""
    first = make_rig(ssd_dir=str(tmp_path / "ssd"))
    second = make_rig(ssd_dir=str(tmp_path / "ssd"))
    assert not second.ssd.healthy
    second.node.register_engine("default", TUNED, "tuned")
    assert [m.model_id for m in second.node.models_of("default")] == [LAYOUT.model_id, "tuned@1"]
    await first.node.close()
    assert sorted(os.listdir(tmp_path / "ssd")) == [FILE_NAME]
    body = json.loads((tmp_path / "ssd" / FILE_NAME).read_text())
    assert [m["model_id"] for m in body.values()] == [LAYOUT.model_id]


async def test_registration_writes_models_file_off_the_calling_thread(
        make_rig: MakeRig, tmp_path: Path) -> None:
    """register_engine opens no models.json file on the caller's thread (the event loop's): the
    writer thread does, and the file has the new model once the node closes."""
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    opened: list[str] = []
    _WATCHED.append((threading.get_ident(), opened))
    try:
        for i in range(20):
            rig.node.register_engine("default", dataclasses.replace(LAYOUT, model_id=f"m{i}@1"))
    finally:
        _WATCHED.clear()
    assert opened == []
    await rig.node.close()
    body = json.loads((tmp_path / "ssd" / FILE_NAME).read_text())
    assert len(body) == 21 and list(body.values())[-1]["model_id"] == "m19@1"


async def test_live_engine_keeps_its_model_past_the_table_bound(make_rig: MakeRig,
                                                                tmp_path: Path) -> None:
    """An engine registered first stays while 1,100 other models come and go (past the default
    1,024 entries): its row, lookups counted, stays in Stats; no counters are orphaned."""
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"))
    for i in range(1100):
        other = rig.node.register_engine("default", dataclasses.replace(LAYOUT,
                                                                        model_id=f"m{i}@1"))
        rig.node.unregister_engine(other.engine_id)
    rig.node.lookup(rig.engine.engine_id, chain(2))
    rig.node.check_integrity()
    mine = [m for m in rig.node.models_of("default") if m.model_id == LAYOUT.model_id]
    assert [(m.engines, m.query_tokens) for m in mine] == [(1, 32)]
    assert len(rig.node.models_of("default")) == 1024


async def test_model_table_holds_at_most_max_models_held_entries_too(make_rig: MakeRig,
                                                                     tmp_path: Path) -> None:
    """max_models=3: six models store a block each and leave; the table keeps the live engine
    and the two most recent, the rest's blocks count in the tier totals only, and the file
    holds the same three."""
    rig = make_rig(ssd_dir=str(tmp_path / "ssd"), max_models=3)
    for i in range(6):
        layout = dataclasses.replace(LAYOUT, model_id=f"m{i}@1")
        other = rig.node.register_engine("default", layout)
        rig.store(chain(1, seed=f"m{i}"), engine=other)
        rig.node.unregister_engine(other.engine_id)
        rig.node.check_integrity()
    rows = {m.model_id: m.blocks["dram"] for m in rig.node.models_of("default")}
    assert rows == {LAYOUT.model_id: 0, "m4@1": 1, "m5@1": 1}
    assert rig.node.stats().tiers["dram"].used_blocks == 6
    await rig.node.close()
    body = json.loads((tmp_path / "ssd" / FILE_NAME).read_text())
    assert [m["model_id"] for m in body.values()] == [LAYOUT.model_id, "m4@1", "m5@1"]


_WATCHED: list[tuple[int, list[str]]] = []
"""(thread, paths of models.json files it opened) while a test watches; the hook stays."""


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event != "open" or not _WATCHED or threading.get_ident() != _WATCHED[-1][0]:
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)) and FILE_NAME in os.fsdecode(path):
        _WATCHED[-1][1].append(os.fsdecode(path))


sys.addaudithook(_audit)
