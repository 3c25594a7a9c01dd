"""TierdHiCacheStorage inside real SGLang 0.5.23: SGLang's own HiCacheController threads back
pages up to tierd and prefetch them back, through a real `tierd serve`."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

pytest.importorskip("sglang", reason="needs real SGLang: run `make test-sglang`")

import torch  # noqa: E402
from harness import PAGE, Engine, tierd_extra, wait_until  # noqa: E402
from harness import host_pool as harness_host  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from tierd.bench.tierd_serve import TierdServe  # noqa: E402
from tierd.types import BlockHash  # noqa: E402
from tierd.wire.layout import Layout  # noqa: E402

pytestmark = pytest.mark.sglang

TOKENS = [(i * 37 + 11) % 997 for i in range(8 * PAGE)]  # 8 pages
MHA_LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]


def backed_up(engine: Engine, tokens: list[int], seed: int) -> list[bytes]:
    """``engine`` writes ``tokens``' pages (random bytes from ``seed``) through to tierd; the
    pages' bytes."""
    indices = engine.fill(len(tokens) // PAGE, seed)
    assert engine.backup(tokens, indices) == len(tokens)
    return engine.pages(indices)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_backup_then_prefetch_byte_exact(daemon: TierdServe, models: tuple[str, str],
                                         layout: str) -> None:
    """Engine A backs 8 pages up; engine B (same model, fresh host pool) prefetches all 8 from
    tierd, byte for byte; no lease is left pinned."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a, b = Engine(extra, layout=layout), Engine(extra, layout=layout)
    try:
        stored = backed_up(a, TOKENS, seed=1)
        hit, loaded, indices = b.prefetch("r1", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert b.pages(indices) == stored
        assert daemon.pinned_blocks() == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_one_copy_for_all_ranks(daemon: TierdServe, models: tuple[str, str],
                                    layout: str) -> None:
    """MLA: rank 1 (not a writer) stores nothing; rank 0 stores one copy; a rank-1 engine of
    another TP group loads it byte-exact (the latent row is the same on every rank)."""
    extra = tierd_extra(daemon.socket_path, models[0])
    r1 = Engine(extra, layout=layout, mla=True, tp_rank=1, tp_size=2)
    r0 = Engine(extra, layout=layout, mla=True, tp_rank=0, tp_size=2)
    other = Engine(extra, layout=layout, mla=True, tp_rank=1, tp_size=2)
    try:
        assert r1.backup(TOKENS, r1.fill(len(TOKENS) // PAGE, seed=3)) == 0  # SGLang skips it
        assert r1.backend.batch_set_v1(get_hash_str(TOKENS, None, page_size=PAGE),
                                       torch.arange(len(TOKENS))) == [True] * (len(TOKENS) // PAGE)
        assert other.prefetch("r0", TOKENS)[:2] == (0, 0)
        stored = backed_up(r0, TOKENS, seed=4)
        hit, loaded, indices = other.prefetch("r1", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert other.pages(indices) == stored
    finally:
        for e in (r1, r0, other):
            e.close()


def test_other_weights_of_one_shape_get_nothing(daemon: TierdServe,
                                                models: tuple[str, str]) -> None:
    """A model with the same config and other weights finds none of the base model's pages;
    the base model's second engine finds all of them."""
    base, tuned = models
    a = Engine(tierd_extra(daemon.socket_path, base))
    t = Engine(tierd_extra(daemon.socket_path, tuned))
    b = Engine(tierd_extra(daemon.socket_path, base))
    try:
        backed_up(a, TOKENS, seed=5)
        assert t.prefetch("t", TOKENS)[:2] == (0, 0)
        assert b.prefetch("b", TOKENS)[:2] == (len(TOKENS), len(TOKENS))
        assert a.backend.identity.model_id != t.backend.identity.model_id
    finally:
        for e in (a, t, b):
            e.close()


def test_daemon_restart_serves_from_ssd(daemon: TierdServe, models: tuple[str, str]) -> None:
    """The daemon is stopped and started again on its SSD directory: the pages are on SSD
    only, and a fresh engine prefetches them byte-exact (the Acquire stages them into DRAM)."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a = Engine(extra)
    try:
        stored = backed_up(a, TOKENS, seed=6)
    finally:
        a.close()
    daemon.restart()
    b = Engine(extra)
    try:
        assert b.backend.format is not None
        with daemon.client() as client:
            probe = client.register_engine(b.backend.format.layout, "probe")
            hashes = [BlockHash(bytes.fromhex(k))
                      for k in get_hash_str(TOKENS, None, page_size=PAGE)]
            assert client.lookup(probe.engine_id, hashes) == ["ssd"] * len(hashes)
            client.unregister_engine(probe.engine_id)
        hit, loaded, indices = b.prefetch("r", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert b.pages(indices) == stored
        assert daemon.pinned_blocks() == 0
    finally:
        b.close()


def test_daemon_down_is_a_miss_then_it_comes_back(daemon: TierdServe,
                                                  models: tuple[str, str]) -> None:
    """With the daemon down, backups store nothing and prefetches find nothing, without an
    exception in SGLang's threads; once it is back the same engine stores and loads again."""
    extra = tierd_extra(daemon.socket_path, models[0])
    daemon.stop(kill=True)
    a = Engine(extra)
    try:
        indices = a.fill(len(TOKENS) // PAGE, seed=7)
        assert a.backup(TOKENS, indices) == 0
        assert a.prefetch("down", TOKENS)[:2] == (0, 0)
        assert all(t.is_alive() for t in (a.controller.backup_thread,
                                          a.controller.prefetch_thread,
                                          a.controller.prefetch_io_aux_thread))
        daemon.start()
        stored = a.pages(indices)
        assert a.backup(TOKENS, indices) == len(TOKENS)
        hit, loaded, got = a.prefetch("up", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert a.pages(got) == stored
        daemon.stop(kill=True)  # killed while registered: the next calls miss
        assert a.prefetch("gone", TOKENS)[:2] == (0, 0)
        assert a.backup(TOKENS, indices) == 0
    finally:
        a.close()


def test_concurrent_engines(daemon: TierdServe, models: tuple[str, str]) -> None:
    """Four engines back up their own prompts (a shared first half) at once from four threads,
    then each prefetches another's, at once: every prefetch is byte-exact, nothing stays pinned.
    The prefetches wait for every backup: a shared page that one engine's backup found another
    engine writing counts as stored for it, and is visible once that other engine's Commit
    lands."""
    extra = tierd_extra(daemon.socket_path, models[0])
    engines = [Engine(extra) for _ in range(4)]
    shared = TOKENS[:4 * PAGE]
    prompts = [shared + [(i * 101 + n) % 997 for n in range(4 * PAGE)] for i in range(4)]
    errors: list[BaseException] = []
    backed_up = threading.Barrier(4, timeout=120)

    def run(i: int) -> None:
        try:
            indices = engines[i].fill(8, seed=10 + i)  # SGLang's host allocator locks itself
            before = engines[i].pages(indices)
            done = engines[i].backup(prompts[i], indices)
            assert done == len(prompts[i])
            backed_up.wait()
            reader = engines[(i + 1) % 4]
            hit, loaded, got = reader.prefetch(f"c{i}", prompts[i])
            assert (hit, loaded) == (len(prompts[i]), len(prompts[i]))
            pages = reader.pages(got)
            assert pages[4:] == before[4:]  # the shared half may come from another writer
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            backed_up.abort()  # the others do not wait for a backup that failed

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert daemon.pinned_blocks() == 0
    finally:
        for e in engines:
            e.close()


def test_vllm_and_sglang_engines_share_one_daemon(daemon: TierdServe,
                                                  models: tuple[str, str]) -> None:
    """A vLLM-format engine (kv_format vllm-hnc-v1) stores blocks under the same hashes, model
    id and shape: SGLang gets none of them, its own pages still load, and the daemon lists
    both engines."""
    extra = tierd_extra(daemon.socket_path, models[0])
    s = Engine(extra)
    try:
        layout = s.backend.format.layout
        vllm = Layout(layout.num_layers, layout.num_kv_heads, layout.head_size, layout.dtype,
                      layout.block_size, kv_format="vllm-hnc-v1", model_id=layout.model_id)
        keys = get_hash_str(TOKENS, None, page_size=PAGE)
        hashes = [BlockHash(bytes.fromhex(k)) for k in keys]
        with daemon.client() as client:
            engine = client.register_engine(vllm, "vllm-tp0")
            reserved = client.reserve(engine.engine_id, hashes)
            assert client.commit(engine.engine_id, reserved.lease_id,
                                 [True] * len(hashes)) == len(hashes)
            assert s.prefetch("miss", TOKENS)[:2] == (0, 0)
            stored = backed_up(s, TOKENS, seed=20)
            hit, loaded, got = s.prefetch("hit", TOKENS)
            assert (hit, loaded) == (len(TOKENS), len(TOKENS))
            assert s.pages(got) == stored
            names = {e.engine_name for e in client.stats().engines}
            assert {"vllm-tp0", "sglang-tp0"} <= names
    finally:
        s.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_legacy_and_v1_engines_share_pages(daemon: TierdServe, models: tuple[str, str],
                                           layout: str) -> None:
    """An engine without ``interface_v1`` (SGLang's flat pages) backs up; a v1 engine loads
    the same bytes, and the other way round."""
    v1 = tierd_extra(daemon.socket_path, models[0])
    legacy = {**v1, "interface_v1": 0}
    old, new = Engine(legacy, layout=layout), Engine(v1, layout=layout)
    try:
        stored = backed_up(old, TOKENS, seed=30)
        hit, loaded, got = new.prefetch("n", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert new.pages(got) == stored
        other = TOKENS[::-1]
        stored = backed_up(new, other, seed=31)
        hit, loaded, got = old.prefetch("o", other)
        assert (hit, loaded) == (len(other), len(other))
        assert old.pages(got) == stored
    finally:
        old.close()
        new.close()


def test_corrupt_slot_is_a_miss_and_dropped(daemon: TierdServe, models: tuple[str, str]) -> None:
    """A byte of a stored page is flipped in the arena: the load stops at that page (SGLang
    gets the pages before it), the daemon drops the page, and the lease is released."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a, b = Engine(extra), Engine(extra)
    try:
        stored = backed_up(a, TOKENS, seed=40)
        keys = get_hash_str(TOKENS, None, page_size=PAGE)
        session = b.backend._session()
        assert session is not None
        got = session.client.acquire(session.engine_id,
                                     [BlockHash(bytes.fromhex(k)) for k in keys])
        session.client.release(session.engine_id, got.lease_id)
        arena = session.arena
        at = session.engine.geometry.offset(got.slot_ids[3]) + 100
        arena[at] ^= 0xFF
        hit, loaded, indices = b.prefetch("c", TOKENS)
        assert loaded == 3 * PAGE
        assert b.pages(indices)[:3] == stored[:3]
        assert daemon.pinned_blocks() == 0
        wait_until(lambda: b.prefetch("again", TOKENS)[0] == 3 * PAGE)
    finally:
        a.close()
        b.close()


def test_refusals_name_the_fix(daemon: TierdServe, models: tuple[str, str]) -> None:
    """SGLang's attach fails with tierd's reason for a page size under 16, and for a hybrid
    model's extra host pool."""
    extra = tierd_extra(daemon.socket_path, models[0])
    with pytest.raises(ValueError, match="page-size >= 16"):
        Engine(extra, page=8)
    e = Engine(extra)
    try:
        with pytest.raises(ValueError, match="hybrid models"):
            e.backend.register_mem_host_pool_v2(object(), "mamba")
        e.backend.register_mem_host_pool_v2(e.host, "kv")  # the KV pool itself is fine
    finally:
        e.close()
    with pytest.raises(ValueError, match="unknown .* key"):
        Engine({**extra, "socket": "/x"})


def test_file_backend_runs_in_the_same_harness(tmp_path: object,
                                               models: tuple[str, str]) -> None:
    """The harness itself is sound: SGLang's own `file` backend round-trips the pages too
    (the reference the benchmark compares tierd with)."""
    extra = {"file_storage_path": str(tmp_path), "model_path": models[0]}
    a, b = Engine(extra, backend="file"), Engine(extra, backend="file")
    try:
        stored = backed_up(a, TOKENS, seed=50)
        hit, loaded, got = b.prefetch("f", TOKENS)
        assert (hit, loaded) == (len(TOKENS), len(TOKENS))
        assert b.pages(got) == stored
    finally:
        a.close()
        b.close()



def test_failed_store_aborts_its_reservation(daemon: TierdServe, models: tuple[str, str]) -> None:
    """A store whose copy fails after its Reserve aborts the reservation (the error reaches
    the caller): the same pages are then stored in full by the next backup."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a = Engine(extra)
    try:
        keys = get_hash_str(TOKENS, None, page_size=PAGE)

        def broken(addresses: object) -> list[int | None]:
            raise RuntimeError("copy failed")

        with pytest.raises(RuntimeError, match="copy failed"):
            a.backend._store(keys, broken)
        indices = a.fill(len(TOKENS) // PAGE, seed=60)
        assert a.backend.batch_set_v1(keys, indices) == [True] * len(keys)
        with daemon.client() as client:
            assert sum(t.used_blocks for t in client.stats().tiers if t.tier == "dram") == \
                len(keys)
    finally:
        a.close()


def test_failed_commit_stores_nothing_and_raises_nothing(daemon: TierdServe,
                                                        models: tuple[str, str]) -> None:
    """The daemon dies between the copy and the Commit (sent without waiting): SGLang's call
    still returns, the failure is settled on the next call (the link drops), nothing is
    stored; once the daemon is back the same pages are stored and found."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a = Engine(extra)
    try:
        keys = get_hash_str(TOKENS, None, page_size=PAGE)
        indices = a.fill(len(TOKENS) // PAGE, seed=65)
        fmt = a.backend.format
        assert fmt is not None
        pages = fmt.pages_of(indices, len(keys))

        def copy_then_die(addresses: Sequence[int | None]) -> list[bool]:
            written = fmt.store(pages, addresses)
            daemon.stop(kill=True)
            return written

        a.backend._store(keys, copy_then_die)
        assert a.backend.batch_exists(keys) == 0 and not a.backend._link.up
        daemon.start()
        wait_until(lambda: a.backend.batch_exists(keys) == 0 and a.backend._link.up)
        assert a.backend.batch_set_v1(keys, indices) == [True] * len(keys)
        assert a.backend.batch_exists(keys) == len(keys)
    finally:
        a.close()


def test_failed_load_releases_its_lease(daemon: TierdServe, models: tuple[str, str]) -> None:
    """A load whose copy fails after its Acquire releases the lease (the error reaches the
    caller): nothing stays pinned, and the pages still load afterwards."""
    extra = tierd_extra(daemon.socket_path, models[0])
    a, b = Engine(extra), Engine(extra)
    try:
        stored = backed_up(a, TOKENS, seed=70)
        keys = get_hash_str(TOKENS, None, page_size=PAGE)

        class Broken:
            def place(self, *args: object) -> int:
                raise RuntimeError("copy failed")

            def settle(self) -> None:
                pass

        with pytest.raises(RuntimeError, match="copy failed"):
            b.backend._load(keys, lambda n: list(range(n)), Broken())
        b.backend.flush()  # the Release is a job on the backend's runner
        assert daemon.pinned_blocks() == 0
        hit, loaded, got = b.prefetch("after", TOKENS)
        assert loaded == len(TOKENS) and b.pages(got) == stored
    finally:
        a.close()
        b.close()


def test_tp_ranks_keep_their_own_shards(daemon: TierdServe, models: tuple[str, str]) -> None:
    """MHA with TP 2: rank 0's pages are not served to rank 1 (other heads under the same
    keys); rank 0 of another engine gets them."""
    extra = tierd_extra(daemon.socket_path, models[0])
    r0 = Engine(extra, tp_rank=0, tp_size=2)
    r1 = Engine(extra, tp_rank=1, tp_size=2)
    other0 = Engine(extra, tp_rank=0, tp_size=2)
    try:
        stored = backed_up(r0, TOKENS, seed=80)
        assert r1.prefetch("r1", TOKENS)[:2] == (0, 0)
        hit, loaded, got = other0.prefetch("r0", TOKENS)
        assert loaded == len(TOKENS) and other0.pages(got) == stored
        assert r1.backend.format.layout.tp_rank == 1
    finally:
        for e in (r0, r1, other0):
            e.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_python_copies_without_the_native_helpers(daemon: TierdServe, models: tuple[str, str],
                                                  layout: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C helper is unavailable (no compiler, TIERD_NATIVE=0) the load verifies, then
    copies: still byte-exact."""
    from tierd.connector.core.arena_slots import ArenaSlots

    monkeypatch.setattr(ArenaSlots, "load_verified", lambda *a, **k: None)
    extra = tierd_extra(daemon.socket_path, models[0])
    a, b = Engine(extra, layout=layout), Engine(extra, layout=layout)
    try:
        stored = backed_up(a, TOKENS, seed=90)
        hit, loaded, got = b.prefetch("py", TOKENS)
        assert loaded == len(TOKENS) and b.pages(got) == stored
    finally:
        a.close()
        b.close()


def test_model_id_from_sglangs_model_name(daemon: TierdServe, models: tuple[str, str]) -> None:
    """Without "model_path", the id is derived from the model path SGLang passes its storage
    backends (``model_name``): the same id, and the same pages."""
    with_path = Engine(tierd_extra(daemon.socket_path, models[0]))
    extra = tierd_extra(daemon.socket_path, models[0])
    del extra["model_path"]
    from_name = Engine(extra, model_name=models[0])
    try:
        assert from_name.backend.identity.model_id == with_path.backend.identity.model_id
        stored = backed_up(with_path, TOKENS, seed=91)
        hit, loaded, got = from_name.prefetch("n", TOKENS)
        assert loaded == len(TOKENS) and from_name.pages(got) == stored
    finally:
        with_path.close()
        from_name.close()


def test_pipeline_stage_and_cp_rank_are_in_the_byte_format(models: tuple[str, str]) -> None:
    """Pipeline stages and context-parallel ranks hold other bytes under the same page keys:
    each gets its own kv_format (so its own namespace); MLA drops the TP rank."""
    from tierd.connector.sglang.pages import Shard, page_format

    host = harness_host("page_first")
    assert page_format(host, Shard(), "m@1").layout.kv_format == "sglang-mha-page_first"
    staged = page_format(host, Shard(pp_rank=1, pp_size=2, cp_rank=0, cp_size=4), "m@1")
    assert staged.layout.kv_format == "sglang-mha-page_first-pp1of2-cp0of4"
    mla = page_format(harness_host("layer_first", mla=True), Shard(tp_rank=3, tp_size=4), "m@1")
    assert (mla.layout.kv_format, mla.layout.tp_rank, mla.layout.tp_size) == (
        "sglang-mla-layer_first", 0, 1)
    assert mla.rows.layers == 3 and mla.page_bytes == mla.layout.block_bytes
