"""The one-pass DRAM load (connector/native): every vLLM KV layout, a pool, failures, fallbacks."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tierd.checksum import block_checksum
from tierd.connector.native import library, verified_copy
from tierd.connector.native.verified_copy import BlockRows, load_verified, store_rows

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@pytest.fixture(params=list(verified_copy.ISAS))
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each load kernel this CPU runs, made the one ``load_verified`` uses: hash-then-copy
    pieces, and xxh3 folded into the copy with AVX2 and with AVX-512 (skipped where the CPU
    lacks them)."""
    native = verified_copy._library()
    isa = verified_copy.ISAS[request.param]
    if native is None or isa > native.cpu_isa:
        pytest.skip(f"no {request.param} load kernel on this machine")
    monkeypatch.setattr(verified_copy, "_loaded", [replace(native, isa=isa)])
    return str(request.param)


def _kv(order: str, layers: int = 3, blocks: int = 9, heads: int = 2, tokens: int = 4,
        width: int = 24) -> torch.Tensor:
    """A zeroed buffer in physical axis ``order`` seen as logical ``[L, B, H, N, C]`` bytes."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": tokens, "C": width}
    buffer = torch.zeros([sizes[a] for a in order], dtype=torch.uint8)
    return buffer.permute([order.index(a) for a in "LBHNC"])


def _slots(n: int, kv: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[int]]:
    """``n`` slots of random bytes in the canonical (layer, head, token) order, and checksums."""
    block_bytes = kv.shape[0] * kv.shape[2] * kv.shape[3] * kv.shape[4]
    slots = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    return slots, [block_checksum(s.numpy().tobytes()) for s in slots]


def _as_blocks(slots: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Slots as ``[L, n, H, N, C]``, comparable with ``kv[:, block_ids]``."""
    layers, _, heads, tokens, width = kv.shape
    return slots.view(-1, layers, heads, tokens, width).transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("order", LAYOUTS)
def test_every_layout_lands_in_canonical_order(order: str, threads: int, kernel: str) -> None:
    """Five slots into blocks 6, 0, 3, 4, 8 of each of vLLM's layouts: all five verify, each
    block holds its slot's bytes in the canonical order, no other block is touched (rows of
    192 bytes take a fused kernel, rows of 24 or 96 bytes the pieces)."""
    kv = _kv(order)
    slots, sums = _slots(5, kv, seed=1)
    block_ids = [6, 0, 3, 4, 8]
    got = load_verified(BlockRows.of(kv), [s.data_ptr() for s in slots], block_ids, sums,
                        threads=threads)
    assert got == 5
    assert torch.equal(kv[:, block_ids], _as_blocks(slots, kv))
    assert int(kv[:, [1, 2, 5, 7]].sum()) == 0


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_counts_leading_blocks_before_the_first_mismatch(threads: int, kernel: str) -> None:
    """Eight blocks whose slot 5 has one flipped byte: 5 verified and in place, whatever the
    thread split (a thread past the failure stops, one before it finishes)."""
    kv = _kv("LBHNC", blocks=8)
    slots, sums = _slots(8, kv, seed=2)
    slots[5, 17] ^= 0x01
    got = load_verified(BlockRows.of(kv), [s.data_ptr() for s in slots], list(range(8)), sums,
                        threads=threads)
    assert got == 5
    assert torch.equal(kv[:, :5], _as_blocks(slots[:5], kv))


@pytest.mark.parametrize("threads", [2, 8])
def test_threads_taking_blocks_as_they_go_count_to_the_lowest_failure(threads: int,
                                                                       kernel: str) -> None:
    """64 blocks, slots 40 and 13 damaged, threads taking blocks one at a time: 13 verified,
    all 13 in place, whichever thread met which failure first."""
    kv = _kv("LBHNC", blocks=64)
    slots, sums = _slots(64, kv, seed=5)
    slots[40, 3] ^= 0x10
    slots[13, 70] ^= 0x02
    got = load_verified(BlockRows.of(kv), [s.data_ptr() for s in slots], list(range(64)), sums,
                        threads=threads)
    assert got == 13
    assert torch.equal(kv[:, :13], _as_blocks(slots[:13], kv))


def test_a_pool_of_rows_larger_than_a_piece(kernel: str) -> None:
    """The reference engine's pool (one 100,000-byte row per block, hashed in 16 KiB pieces):
    rows 2 and 0 land bit-exact; a wrong checksum for the second stops there."""
    pool = torch.zeros(3, 100_000, dtype=torch.uint8)
    slots = torch.randint(0, 256, (2, 100_000), dtype=torch.uint8)
    sums = [block_checksum(s.numpy().tobytes()) for s in slots]
    rows, addresses = BlockRows.of(pool), [s.data_ptr() for s in slots]
    assert load_verified(rows, addresses, [2, 0], sums) == 2
    assert torch.equal(pool[[2, 0]], slots)
    assert load_verified(rows, addresses, [2, 0], [sums[0], sums[1] + 1]) == 1


@pytest.mark.parametrize("tail", [48, 0], ids=["ragged", "stripes"])
@pytest.mark.parametrize("skew", [0, 1], ids=["aligned", "unaligned"])
def test_a_large_load_is_exact_with_streaming_stores(skew: int, tail: int, kernel: str) -> None:
    """Five blocks of 2 MiB (+ 48 bytes: a tail under one 64-byte store, so the pieces) (10 MiB:
    past the non-temporal-store threshold) into 16-byte-aligned pool rows, or rows one byte off
    (plain copies): bit-exact either way, and a flipped byte in the third block stops the
    count."""
    width = (2 << 20) + tail
    pool = torch.zeros(6, width + 16, dtype=torch.uint8)[:, skew:skew + width]
    slots = torch.randint(0, 256, (5, width), dtype=torch.uint8)
    sums = [block_checksum(s.numpy().tobytes()) for s in slots]
    rows, addresses = BlockRows.of(pool), [s.data_ptr() for s in slots]
    assert load_verified(rows, addresses, [5, 0, 1, 2, 3], sums) == 5
    assert torch.equal(pool[[5, 0, 1, 2, 3]], slots)
    assert int(pool[4].sum()) == 0
    slots[2, width // 2] ^= 0x40
    assert load_verified(rows, addresses, [5, 0, 1, 2, 3], sums) == 2


@pytest.mark.parametrize("kernel", ["avx2", "avx512"], indirect=True)
def test_a_fused_kernel_agrees_with_block_checksum_at_every_turn(kernel: str) -> None:
    """Every whole number of stripes from 4 to 70 (past four of xxh3's 1 KiB turns, every
    position of the last stripe in one) and 2 MiB: the block verifies and lands; with one
    byte flipped anywhere (first stripe, a turn, the last stripe) it does not."""
    gen = torch.Generator().manual_seed(7)
    for length in [*range(256, 70 * 64 + 1, 64), 2 << 20]:
        pool = torch.zeros(2, length, dtype=torch.uint8)
        slot = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen)
        want = block_checksum(slot.numpy().tobytes())
        assert load_verified(BlockRows.of(pool), [slot.data_ptr()], [1], [want]) == 1, length
        assert torch.equal(pool[1], slot) and int(pool[0].sum()) == 0
        for at in {a for a in (0, 1023, 1024, length - 64, length - 1) if a < length}:
            slot[at] ^= 0x80
            assert load_verified(BlockRows.of(pool), [slot.data_ptr()], [1], [want]) == 0
            slot[at] ^= 0x80


def test_the_best_kernel_this_cpu_runs_is_the_one_used() -> None:
    """The kernels that fold xxh3 into the copy agreed with python-xxhash at load, so the best
    this CPU runs is in use (a disagreement would drop to the next, with a warning)."""
    native = verified_copy._library()
    assert native is not None and native.isa == native.cpu_isa


def test_tierd_load_kernel_caps_the_kernel(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """``TIERD_LOAD_KERNEL=pieces`` keeps the hash-then-copy kernel (an A/B, or a CPU where
    the fused one should not run); a name it does not know is ignored with a warning."""
    monkeypatch.setenv("TIERD_LOAD_KERNEL", "pieces")
    native = verified_copy._load()
    assert native is not None and native.isa == native.cpu_isa == verified_copy.ISAS["pieces"]
    monkeypatch.setenv("TIERD_LOAD_KERNEL", "sse9")
    with caplog.at_level(logging.WARNING):
        native = verified_copy._load()
    assert "TIERD_LOAD_KERNEL=sse9 is not one of pieces, avx2, avx512" in caplog.text
    assert native is not None and native.isa == verified_copy._library().isa


def test_layouts_coalesce_to_the_fewest_rows() -> None:
    """vLLM's CPU layout copies one row per layer and block; block-major BLHNC one per block;
    FlashAttention's LBNHC needs one per head and token."""
    lbhnc, blhnc, lbnhc = (BlockRows.of(_kv(o)) for o in ("LBHNC", "BLHNC", "LBNHC"))
    assert (lbhnc.layers, lbhnc.heads, lbhnc.tokens, lbhnc.row) == (3, 1, 1, 2 * 4 * 24)
    assert (blhnc.layers, blhnc.heads, blhnc.tokens, blhnc.row) == (1, 1, 1, 3 * 2 * 4 * 24)
    assert (lbnhc.layers, lbnhc.heads, lbnhc.tokens, lbnhc.row) == (3, 2, 4, 24)
    assert lbhnc.block_bytes == blhnc.block_bytes == lbnhc.block_bytes == 3 * 2 * 4 * 24


def test_bad_arguments_are_refused_before_any_copy() -> None:
    kv = _kv("LBHNC")
    rows = BlockRows.of(kv)
    with pytest.raises(ValueError, match="must lie in"):
        load_verified(rows, [0], [9], [0])
    with pytest.raises(ValueError, match="one engine block and one checksum"):
        load_verified(rows, [0, 1], [0], [0])
    with pytest.raises(ValueError, match="host uint8"):
        BlockRows.of(kv.view(torch.int8))
    with pytest.raises(ValueError, match=r"\[L, B, H, N, C\]"):
        BlockRows.of(kv[0])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("order", LAYOUTS)
def test_a_store_writes_each_block_in_canonical_order(order: str, threads: int) -> None:
    """Blocks 6, 0 and 3 of each of vLLM's layouts stored into three slots: each slot holds
    its block's rows back to back in (layer, head, token) order, as a load expects them."""
    kv = _kv(order)
    kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8))
    slots = torch.zeros(3, kv.shape[0] * kv.shape[2] * kv.shape[3] * kv.shape[4],
                        dtype=torch.uint8)
    assert store_rows(BlockRows.of(kv), [s.data_ptr() for s in slots], [6, 0, 3],
                      threads=threads)
    assert torch.equal(_as_blocks(slots, kv), kv[:, [6, 0, 3]])


def test_a_large_store_is_exact_with_streaming_stores() -> None:
    """Five pool rows of 2 MiB + 48 bytes (past the non-temporal threshold, a ragged tail)
    stored into slots in another order: bit-exact; an out-of-range block id is refused."""
    width = (2 << 20) + 48
    pool = torch.randint(0, 256, (6, width), dtype=torch.uint8)
    slots = torch.zeros(5, width + 16, dtype=torch.uint8)[:, :width]
    assert store_rows(BlockRows.of(pool), [s.data_ptr() for s in slots], [5, 0, 1, 2, 3])
    assert torch.equal(slots, pool[[5, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="block ids"):
        store_rows(BlockRows.of(pool), [slots[0].data_ptr()], [6])


def test_without_the_helper_nothing_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """No native helper (no compiler, TIERD_NATIVE=0): None, and the engine's KV untouched."""
    monkeypatch.setattr(verified_copy, "_loaded", [None])
    kv = _kv("LBHNC")
    slots, sums = _slots(2, kv, seed=3)
    before = slots.clone()
    assert load_verified(BlockRows.of(kv), [s.data_ptr() for s in slots], [0, 1], sums) is None
    assert not store_rows(BlockRows.of(kv), [s.data_ptr() for s in slots], [0, 1])
    assert int(kv.sum()) == 0 and torch.equal(slots, before)


def test_the_library_is_built_where_tierd_is_installed() -> None:
    """``make venv`` (an editable install) built the helpers beside ``library.py``, under this
    Python's extension name, and they load."""
    path = library.find()
    assert path is not None and path.parent == Path(library.__file__).parent
    assert library.shared_library() is not None and verified_copy.available()


def test_a_missing_or_unloadable_library_falls_back_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """TIERD_NATIVE=0: None, and no warning; a folder without the library: None, and a WARNING
    naming the Python paths' cost and how to build it; a file that is not a library: None, and
    a WARNING naming it. A build for another Python of the machine is found too."""
    try:
        monkeypatch.setenv("TIERD_NATIVE", "0")
        library.shared_library.cache_clear()
        with caplog.at_level(logging.WARNING):
            assert library.shared_library() is None
        assert not caplog.records
        monkeypatch.delenv("TIERD_NATIVE")
        find = library.find
        monkeypatch.setattr(library, "find", lambda: find(tmp_path))
        library.shared_library.cache_clear()
        with caplog.at_level(logging.WARNING):
            assert library.shared_library() is None
        assert "not built" in caplog.text and "reads the arena twice" in caplog.text
        assert "make native" in caplog.text
        (tmp_path / "_native.cpython-399-x86_64-linux-gnu.so").write_text("not a library")
        assert find(tmp_path) == tmp_path / (
            "_native.cpython-399-x86_64-linux-gnu.so")
        library.shared_library.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert library.shared_library() is None
        assert "do not load" in caplog.text and "cpython-399" in caplog.text
    finally:
        library.shared_library.cache_clear()
