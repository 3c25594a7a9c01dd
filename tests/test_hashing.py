"""The block-hash contract: vLLM 0.33's known answers (plain and tagged extra keys), extra-key
order and shapes, the KV-event form, salt isolation, chaining, incremental == one-shot,
determinism across processes, and random inputs against vLLM's construction written out.
``tests/vllm/`` checks the same against vLLM itself."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd import hashing
from tierd.hashing import (
    BLOCK_SIZES,
    VLLM_HASH_CONTRACT,
    BlockHasher,
    ExtraKey,
    ExtraKeys,
    HashAlgo,
    MultiModalItem,
    block_hashes,
    hash_block,
    none_hash,
    to_event_extra_keys,
)

NONE_HASH_HEX = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
BLOCK0_HEX = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"


def digest(algo: HashAlgo, data: bytes) -> bytes:
    if algo == "sha256_cbor":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def reference_chain(
    tokens: Sequence[int],
    block_size: int,
    extras: Sequence[tuple[Any, ...] | None] | None = None,
    *,
    algo: HashAlgo = "sha256_cbor",
    seed: str = "vllm-none-hash",
) -> list[bytes]:
    """vLLM's construction written out with cbor2: H((parent, tuple(block), extra_keys)), for
    any extra keys (the tagged ones, or the pre-0.33 untagged shapes)."""
    parent = digest(algo, cbor2.dumps(seed, canonical=True))
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = extras[i] if extras is not None else None
        parent = digest(algo, cbor2.dumps((parent, block, extra), canonical=True))
        out.append(parent)
    return out


def reference_extras(
    index: int,
    block_size: int,
    *,
    lora: tuple[str, str] | None = None,
    salt: str | None = None,
    mm: Sequence[MultiModalItem] = (),
    embeds: Any = None,
) -> ExtraKeys | None:
    """vLLM 0.33's tagged extra keys for block ``index`` (sorted, non-overlapping multimodal
    items); ``lora`` is (name, path)."""
    start, end = index * block_size, (index + 1) * block_size
    keys: list[ExtraKey] = [] if lora is None else [("lora", *lora)]
    overlapping = [m for m in mm if m.offset < end and m.offset + m.length > start]
    keys += [("mm", m.identifier, m.offset - start) for m in overlapping]
    if index == 0 and salt:
        keys.append(("cache_salt", salt))
    if embeds is not None:
        keys.append(("prompt_embeds", hashlib.sha256(embeds[start:end].tobytes()).digest()))
    return tuple(keys) if keys else None


def test_known_answer() -> None:
    """Block size 16, tokens 0..15, no extra keys: vLLM's NONE_HASH and block-0 hash."""
    assert none_hash().hex() == NONE_HASH_HEX
    assert [h.hex() for h in block_hashes(range(16))] == [BLOCK0_HEX]
    assert hash_block(None, range(16)).hex() == BLOCK0_HEX
    assert block_hashes(range(16), algo="xxhash_cbor") == reference_chain(
        range(16), 16, algo="xxhash_cbor"
    )
    assert none_hash(algo="xxhash_cbor") == xxhash.xxh3_128_digest(b"\x6evllm-none-hash")


# Produced by vLLM 0.33.0's own get_request_block_hasher on vllm.v1.request.Request objects
# (block size 16), PYTHONHASHSEED unset except where a case says so.
LORA = ("lora-a", "/adapters/lora-a")
VLLM_LORA_SALT_0_31 = [
    "a299f5955cd9fe810db7b5805a66c362692a023a5748e37e6e984bd05101dea8",
    "9a626ddb5a7f7bbba6bef34480bf681ac81216fec805b194e98dc76560b87544",
]
VLLM_LORA_SALT_0_31_SEED_42 = [
    "34ff40b7bbd5fa76afcbc5879fa900d57184757263f2f413c32fbe7f8b6f9cf2",
    "64ee2770f1ef0b02bf9e84623e566c92d9030e78ce47d4093e227ac5f597c377",
]
VLLM_MM_0_31 = [  # one item "img-0" at positions 4..23
    "cdfa4ff06a92d8aa227141f89aff18054f0fe571bc46df78f070d3ee2dec7974",
    "51b3bfcd754bf73c6f9d2f2ebb55e9b98599306843bf82c33d11b4ea296953cc",
]
VLLM_EMBEDS = "7a6744fc786b208d3a1e0a94d5acdf3e933671b6e444a5c74ac5ab62281e463d"
VLLM_XXH_MIXED_SEED_42 = "e656219856764c0095f5ff49fc4735fc"  # LoRA, img-0, salt; tokens 0..15


def test_vllm_033_known_answers_for_tagged_keys() -> None:
    """LoRA (name, path) + salt, a multimodal item, prompt embeds and xxhash_cbor with
    PYTHONHASHSEED=42 give the digests vLLM 0.33.0 computed for the same requests."""
    import torch

    assert VLLM_HASH_CONTRACT == "0.33"
    tokens = list(range(32))
    lora: dict[str, Any] = {"lora_name": LORA[0], "lora_path": LORA[1]}
    got = block_hashes(tokens, cache_salt="tenant-7", **lora)
    assert [h.hex() for h in got] == VLLM_LORA_SALT_0_31
    got = block_hashes(tokens, cache_salt="tenant-7", seed="42", **lora)
    assert [h.hex() for h in got] == VLLM_LORA_SALT_0_31_SEED_42
    mm = [MultiModalItem("img-0", 4, 20)]
    assert [h.hex() for h in block_hashes(tokens, mm_features=mm)] == VLLM_MM_0_31
    embeds = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    assert block_hashes([0] * 16, prompt_embeds=embeds)[0].hex() == VLLM_EMBEDS
    assert block_hashes([0] * 16, prompt_embeds=embeds.numpy())[0].hex() == VLLM_EMBEDS
    got = block_hashes(
        range(16), algo="xxhash_cbor", seed="42", cache_salt="tenant-7", mm_features=mm, **lora
    )
    assert got[0].hex() == VLLM_XXH_MIXED_SEED_42


def test_untagged_pre_033_keys_no_longer_match() -> None:
    """The untagged shapes tierd hashed before (vLLM < 0.33) give other hashes than 0.33's."""
    tokens = list(range(32))
    old = reference_chain(tokens, 16, [(LORA[0], "tenant-7"), (LORA[0],)])
    assert [h.hex() for h in old] != VLLM_LORA_SALT_0_31


def test_event_form_is_untagged() -> None:
    """to_event_extra_keys gives what vLLM 0.33's KV events publish: tags and LoRA path gone."""
    keys: ExtraKeys = (
        ("lora", "l", "/p"),
        ("mm", "img", -3),
        ("cache_salt", "s"),
        ("prompt_embeds", b"\x01" * 32),
    )
    assert to_event_extra_keys(keys) == ("l", ("img", -3), "s", b"\x01" * 32)
    assert to_event_extra_keys(None) is None
    hasher = BlockHasher(16, lora_name="l", lora_path="/p", cache_salt="s")
    assert hasher.keys.for_block(0, 16)[0] == (("lora", "l", "/p"), ("cache_salt", "s"))
    assert hasher.keys.for_block(16, 32)[0] == (("lora", "l", "/p"),)


def test_lora_name_without_path_warns_and_matches_no_vllm_block(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A LoRA name alone (the pre-0.33 input) still hashes, with ("lora", name, None), and logs
    once that vLLM 0.33 needs the path; a path without a name is a ValueError."""
    from tierd import extra_keys

    extra_keys._warn_no_lora_path.cache_clear()
    tokens = list(range(32))
    with caplog.at_level(logging.WARNING, logger="tierd.extra_keys"):
        got = block_hashes(tokens, lora_name=LORA[0])
        BlockHasher(16, lora_name="other")
    assert got == reference_chain(tokens, 16, [(("lora", LORA[0], None),)] * 2)
    assert got != block_hashes(tokens, lora_name=LORA[0], lora_path=LORA[1])
    assert sum("lora_path" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="pass both"):
        block_hashes(tokens, lora_path=LORA[1])


def test_seed_changes_root_not_environment() -> None:
    """seed="42" is what vLLM with PYTHONHASHSEED=42 uses; the default ignores the variable."""
    assert none_hash("42") == hashlib.sha256(cbor2.dumps("42")).digest()
    assert block_hashes(range(32), seed="42") == reference_chain(range(32), 16, seed="42")
    assert block_hashes(range(32), seed="42") != block_hashes(range(32))


def test_partial_blocks_never_hashed() -> None:
    """15 tokens give no hash, 31 give one, and the trailing partial block never counts."""
    tokens = list(range(100, 147))
    assert block_hashes(tokens[:15]) == []
    assert block_hashes([]) == []
    assert block_hashes(tokens[:31]) == block_hashes(tokens[:16])
    assert len(block_hashes(tokens)) == 2
    assert len(block_hashes(tokens, 8)) == 5


def test_chain_links_parent_and_continues_from_parent() -> None:
    """Block i hashes block i-1's hash; parent= continues the chain without the salt again."""
    tokens = list(range(48))
    plain = block_hashes(tokens)
    assert plain[1] == hash_block(plain[0], tokens[16:32])
    assert block_hashes(tokens[16:], parent=plain[0]) == plain[1:]
    salted = block_hashes(tokens, cache_salt="tenant-a")
    assert block_hashes(tokens[16:], parent=salted[0], cache_salt="tenant-a") == salted[1:]
    lora: dict[str, Any] = {"lora_name": LORA[0], "lora_path": LORA[1]}
    with_lora = block_hashes(tokens, **lora)
    assert block_hashes(tokens[16:], parent=with_lora[0], **lora) == with_lora[1:]


def test_extra_keys_in_vllm_order() -> None:
    """Tagged keys: ("lora", name, path), ("mm", id, offset from block start), ("cache_salt",
    salt) on block 0, ("prompt_embeds", sha256), in that order."""
    tokens = [7] * 48
    mm = [MultiModalItem("img-a", 4, 20), MultiModalItem("img-b", 36, 4)]
    embeds = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    got = block_hashes(
        tokens,
        lora_name="lora-x",
        lora_path="/p/x",
        cache_salt="salt-1",
        mm_features=mm,
        prompt_embeds=embeds,
    )
    d = [hashlib.sha256(embeds[s : s + 16].tobytes()).digest() for s in (0, 16, 32)]
    lora: ExtraKey = ("lora", "lora-x", "/p/x")
    extras: list[ExtraKeys | None] = [
        (lora, ("mm", "img-a", 4), ("cache_salt", "salt-1"), ("prompt_embeds", d[0])),
        (lora, ("mm", "img-a", -12), ("prompt_embeds", d[1])),
        (lora, ("mm", "img-b", 4), ("prompt_embeds", d[2])),  # rows 32..39: vLLM slices past
    ]
    assert got == reference_chain(tokens, 16, extras)
    first = extras[0]
    assert first is not None
    swapped: list[ExtraKeys | None] = [(first[2], first[0], first[1], first[3]), *extras[1:]]
    assert reference_chain(tokens, 16, swapped)[0] != got[0]


def test_multimodal_item_spanning_blocks() -> None:
    """An item keys every block it overlaps with its offset from that block's start (negative
    once it began earlier); one block may hold several items; blocks past them have none."""
    tokens = list(range(80))
    mm = [MultiModalItem("video", 2, 40), MultiModalItem("a", 44, 2), MultiModalItem("b", 46, 3)]
    extras: list[ExtraKeys | None] = [
        (("mm", "video", 2),),
        (("mm", "video", -14),),
        (("mm", "video", -30), ("mm", "a", 12), ("mm", "b", 14)),
        (("mm", "b", -2),),
        None,
    ]
    assert block_hashes(tokens, mm_features=mm) == reference_chain(tokens, 16, extras)


def test_salt_isolation() -> None:
    """Same tokens: different salts differ on every block; the same salt is identical."""
    tokens = list(range(64))
    a, b = block_hashes(tokens, cache_salt="tenant-a"), block_hashes(tokens, cache_salt="tenant-b")
    plain = block_hashes(tokens)
    assert len(a) == 4
    assert all(x != y and x != z for x, y, z in zip(a, b, plain))
    assert block_hashes(tokens, cache_salt="tenant-a") == a
    assert block_hashes(tokens, cache_salt="") == plain  # vLLM treats an empty salt as none
    # The salt is an extra key of block 0 only; the chain carries it onward.
    assert a[1] == hash_block(a[0], tokens[16:32], None)


def test_lora_on_every_block() -> None:
    """("lora", name, path) is an extra key of every block, not just the first; another path
    under the same name gives other hashes (a re-pointed adapter never reuses old KV)."""
    tokens = list(range(32))
    got = block_hashes(tokens, lora_name="adapter", lora_path="/a/1")
    key: ExtraKeys = (("lora", "adapter", "/a/1"),)
    assert got == reference_chain(tokens, 16, [key, key])
    assert block_hashes(tokens, lora_name="adapter", lora_path="/a/2")[0] != got[0]


def test_incremental_equals_one_shot() -> None:
    """Feeding tokens in random chunks (decode: one at a time) gives the one-shot hashes."""
    rng = random.Random(7)
    tokens = [rng.randrange(2**32) for _ in range(300)]
    mm = [MultiModalItem("m0", 5, 30), MultiModalItem("m1", 70, 50)]
    embeds = np.ones((200, 3), dtype=np.float16)
    kwargs: dict[str, Any] = dict(
        lora_name="l", lora_path="/l", cache_salt="s", mm_features=mm, prompt_embeds=embeds
    )
    for block_size in (8, 16, 128):
        expected = block_hashes(tokens, block_size, **kwargs)
        hasher = BlockHasher(block_size, **kwargs)
        got: list[bytes] = []
        position = 0
        while position < len(tokens):
            step = rng.choice((1, 1, 3, block_size, 2 * block_size + 5))
            got += hasher.append(tokens[position : position + step])
            position += step
        assert got == expected
        assert hasher.num_blocks == len(expected)
        assert hasher.num_pending == len(tokens) % block_size
        assert hasher.last_hash == expected[-1]


def test_append_returns_only_new_blocks() -> None:
    """append() returns [] until a block fills, then exactly the newly completed hashes."""
    hasher = BlockHasher(16)
    assert hasher.last_hash is None
    assert hasher.append(range(15)) == []
    assert hasher.num_pending == 15
    assert [h.hex() for h in hasher.append([15])] == [BLOCK0_HEX]
    assert hasher.append(range(16, 40)) == block_hashes(range(48))[1:2]
    assert hasher.num_pending == 8


def test_array_inputs_accepted() -> None:
    """NumPy and torch token arrays hash like the same ids as a list; embeds likewise."""
    import torch

    tokens = list(range(1000, 1032))
    assert block_hashes(np.array(tokens, dtype=np.int64)) == block_hashes(tokens)
    assert block_hashes(torch.tensor(tokens)) == block_hashes(tokens)
    rows = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    assert block_hashes(tokens, prompt_embeds=torch.from_numpy(rows)) == block_hashes(
        tokens, prompt_embeds=rows
    )


@pytest.mark.parametrize("block_size", [16, 32])
def test_int_like_elements_hash_as_their_values(block_size: int) -> None:
    """NumPy ints and bools in a list hash as the ints they equal."""
    tokens = list(range(2 * block_size))
    mixed: list[Any] = [np.int64(t) if t % 3 else t for t in tokens]
    mixed[1] = True
    assert block_hashes(mixed, block_size) == block_hashes(tokens, block_size)
    assert block_hashes(tokens, block_size) == reference_chain(tokens, block_size)


_CHILD = (
    "from tierd.hashing import block_hashes;"
    "print(','.join(h.hex() for h in block_hashes(range(40), cache_salt='t', lora_name='l',"
    " lora_path='/l')))"
)


def test_deterministic_across_processes() -> None:
    """Subprocesses with different PYTHONHASHSEED values compute the same hashes as this one."""
    expected = ",".join(
        h.hex() for h in block_hashes(range(40), cache_salt="t", lora_name="l", lora_path="/l")
    )
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        child = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        assert child.stdout.strip() == expected


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (lambda: block_hashes(range(32), 12), "8, 16, 32, 64, 128"),
        (lambda: block_hashes([1, -1]), "[0, 4294967295]"),
        (lambda: block_hashes([2**32]), "[0, 4294967295]"),
        (lambda: block_hashes([1.5]), "integers"),  # type: ignore[list-item]
        (lambda: block_hashes(["3"]), "integers"),  # type: ignore[list-item]
        (lambda: block_hashes([1], algo="md5"), "use one of sha256_cbor"),  # type: ignore[arg-type]
        (
            lambda: block_hashes(
                [1], mm_features=[MultiModalItem("b", 9, 1), MultiModalItem("a", 2, 1)]
            ),
            "sorted by offset",
        ),
        (lambda: block_hashes([1], mm_features=[MultiModalItem("a", 0, 0)]), "length > 0"),
        (lambda: BlockHasher(16).append([0, -5]), "[0, 4294967295]"),
        (lambda: block_hashes([1], prompt_embeds=[[0.5]]), "torch tensor or NumPy array"),
    ],
)
def test_bad_input_raises_value_error_naming_the_fix(call: Any, fix: str) -> None:
    """Bad block size, token ids, algorithm or multimodal list: ValueError saying what to do."""
    with pytest.raises(ValueError) as info:
        call()
    assert fix in str(info.value)


def test_xxhash_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """Choosing xxhash_cbor logs one warning per process that it is not collision resistant."""
    hashing._warn_xxhash.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tierd.hashing"):
        block_hashes(range(32), algo="xxhash_cbor")
        BlockHasher(16, algo="xxhash_cbor")
    warnings = [r for r in caplog.records if "not collision resistant" in r.getMessage()]
    assert len(warnings) == 1


# ---- random inputs against vLLM's construction ------------------------------------------------

_uint32 = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def _mm_items(draw: st.DrawFn) -> list[MultiModalItem]:
    items, offset = [], 0
    for i in range(draw(st.integers(0, 4))):
        offset += draw(st.integers(0, 40))
        length = draw(st.integers(1, 60))
        items.append(MultiModalItem(draw(st.text(max_size=8)) + str(i), offset, length))
        offset += length
    return items


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    tokens=st.lists(_uint32, max_size=300),
    lora=st.none() | st.tuples(st.text(max_size=12), st.text(min_size=1, max_size=12)),
    salt=st.none() | st.text(max_size=12),
    mm=_mm_items(),
    algo=st.sampled_from(hashing.HASH_ALGOS),
)
def test_random_inputs_match_the_reference_chain(
    block_size: int,
    tokens: list[int],
    lora: tuple[str, str] | None,
    salt: str | None,
    mm: list[MultiModalItem],
    algo: HashAlgo,
) -> None:
    """Random uint32 tokens and extra keys: the hashes equal vLLM's construction, bit for bit."""
    extras = [
        reference_extras(i, block_size, lora=lora, salt=salt, mm=mm)
        for i in range(len(tokens) // block_size)
    ]
    name, path = lora if lora is not None else (None, None)
    got = block_hashes(
        tokens,
        block_size,
        algo=algo,
        cache_salt=salt,
        lora_name=name,
        lora_path=path,
        mm_features=mm,
    )
    assert got == reference_chain(tokens, block_size, extras, algo=algo)
