"""tierd.hashing against vLLM 0.33's own block hasher: random requests of every kind (plain,
salt, LoRA, multimodal, prompt embeds, all mixed), both CBOR algorithms, PYTHONHASHSEED set and
unset, hashed by ``get_request_block_hasher`` on real ``vllm.v1.request.Request`` objects."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test-vllm runs tests/vllm/ in its venv)")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor, xxhash_cbor  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from tierd.hashing import (  # noqa: E402
    VLLM_HASH_CONTRACT,
    BlockHasher,
    HashAlgo,
    MultiModalItem,
    block_hashes,
    to_event_extra_keys,
)

Kind = Literal["plain", "salt", "lora", "mm", "embeds", "mixed"]
KINDS: tuple[Kind, ...] = ("plain", "salt", "lora", "mm", "embeds", "mixed")
CASES_PER_TEST = 40  # x 6 kinds x 2 algorithms x 2 seed modes = 960 random requests
HASH_FNS = {"sha256_cbor": sha256_cbor, "xxhash_cbor": xxhash_cbor}


@dataclass
class Case:
    """One random request, as vLLM gets it and as tierd's inputs say it."""

    block_size: int
    prompt_token_ids: list[int] | None
    hashed_tokens: list[int]
    """The tokens vLLM hashes: prompt ids, 0 where prompt embeds stand in for a token."""
    prompt_embeds: torch.Tensor | None
    prompt_is_token_ids: list[bool] | None
    mm: list[MultiModalItem]
    lora: tuple[str, str] | None
    salt: str | None
    output: list[int]


def _text(rng: random.Random, empty_ok: bool = True) -> str:
    alphabet = "abcxyz-_/.0123456789é雪🙂"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0 if empty_ok else 1, 12)))


def _token(rng: random.Random) -> int:
    return rng.choice((rng.randrange(24), rng.randrange(256), rng.randrange(152_064),
                       rng.randrange(2**32)))


def random_case(rng: random.Random, kind: Kind) -> Case:
    """A request of ``kind`` with random length, ids, keys and decode tokens to follow."""
    block_size = rng.choice((8, 16, 16, 32, 64, 128))
    n = rng.randrange(1, 5 * block_size + 7)
    tokens = [_token(rng) for _ in range(n)]
    case = Case(block_size, tokens, list(tokens), None, None, [], None, None,
                [_token(rng) for _ in range(rng.randrange(0, 2 * block_size + 3))])
    if kind in ("salt", "mixed"):
        case.salt = _text(rng)
    if kind in ("lora", "mixed"):
        case.lora = (_text(rng), _text(rng, empty_ok=False))  # vLLM asserts a non-empty path
    if kind in ("mm", "mixed"):
        offset = rng.randrange(0, 8)
        while offset < n and len(case.mm) < 5:  # sorted and non-overlapping, as vLLM keeps them
            length = rng.randrange(1, min(n - offset, 3 * block_size) + 1)
            case.mm.append(MultiModalItem(f"{_text(rng)}#{len(case.mm)}", offset, length))
            offset += length + rng.randrange(0, block_size)
    if kind in ("embeds", "mixed"):
        dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        case.prompt_embeds = torch.randn(n, rng.choice((1, 4, 8)), generator=gen).to(dtype)
        mode = rng.choice(("embeds only", "ids too", "interleaved"))
        if mode == "embeds only":
            case.prompt_token_ids, case.hashed_tokens = None, [0] * n
        elif mode == "interleaved":
            mask = [rng.random() < 0.5 for _ in range(n)]
            case.prompt_is_token_ids = mask
            case.hashed_tokens = [t if keep else 0 for t, keep in zip(tokens, mask)]
    return case


def vllm_request(case: Case, hash_fn: Any) -> Request:
    """The request as vLLM's engine core builds it, with vLLM's own block hasher attached."""
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=m.identifier,
                              mm_position=PlaceholderRange(offset=m.offset, length=m.length))
        for m in case.mm
    ]
    lora = None if case.lora is None else LoRARequest(case.lora[0], 1, case.lora[1])
    return Request(
        request_id="r",
        prompt_token_ids=case.prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max(len(case.output), 1)),
        pooling_params=None,
        prompt_embeds=case.prompt_embeds,
        prompt_is_token_ids=case.prompt_is_token_ids,
        mm_features=features or None,
        lora_request=lora,
        cache_salt=case.salt,
        block_hasher=kcu.get_request_block_hasher(case.block_size, hash_fn),
    )


def vllm_hashes(request: Request) -> list[bytes]:
    """vLLM's block hashes of the request so far (its BlockHash type, as plain bytes)."""
    return list(request.block_hashes)


def tierd_hasher(case: Case, algo: HashAlgo, seed: str | None) -> BlockHasher:
    name, path = case.lora if case.lora is not None else (None, None)
    return BlockHasher(case.block_size, algo=algo, seed=seed, cache_salt=case.salt,
                       lora_name=name, lora_path=path, mm_features=case.mm,
                       prompt_embeds=case.prompt_embeds)


@pytest.fixture
def none_hash_state() -> Iterator[None]:
    """vLLM keeps NONE_HASH in module globals: restore them (and PYTHONHASHSEED) afterwards."""
    saved = (getattr(kcu, "NONE_HASH", None), kcu._NONE_HASH_SEED,
             os.environ.get("PYTHONHASHSEED"))
    yield
    kcu.NONE_HASH, kcu._NONE_HASH_SEED = saved[0], saved[1]  # type: ignore[assignment]
    if saved[2] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = saved[2]


def init_vllm(algo: HashAlgo, hashseed: str | None) -> str | None:
    """Run vLLM's init_none_hash as its engine core does at start-up, with PYTHONHASHSEED set
    to ``hashseed`` or unset; return the seed tierd must be given (None: its default)."""
    if hashseed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = hashseed
    kcu.init_none_hash(HASH_FNS[algo])
    seed = kcu.get_none_hash_seed()
    if hashseed is None and algo == "sha256_cbor":
        assert seed == "vllm-none-hash", "vLLM's fixed default seed is tierd's default"
        return None
    # Set: the variable's text. Unset with xxhash: vLLM's per-process random seed, which
    # tierd matches only when told it.
    assert hashseed is None or seed == hashseed
    return seed


@pytest.mark.parametrize("hashseed", [None, "set"], ids=["PYTHONHASHSEED-unset",
                                                           "PYTHONHASHSEED-set"])
@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("kind", KINDS)
def test_random_requests_match_vllm(kind: Kind, algo: HashAlgo, hashseed: str | None,
                                    none_hash_state: None) -> None:
    """40 random requests of one kind: tierd's chain, per-block extra keys and their KV-event
    form equal vLLM's, on the prompt and then token by token through decode."""
    rng = random.Random(f"{kind}-{algo}-{hashseed}")
    for _ in range(CASES_PER_TEST):
        case = random_case(rng, kind)
        seed = init_vllm(algo, None if hashseed is None else str(rng.randrange(2**32)))
        request = vllm_request(case, HASH_FNS[algo])
        hasher = tierd_hasher(case, algo, seed)
        ours: list[bytes] = list(hasher.append(case.hashed_tokens))
        assert ours == vllm_hashes(request), case
        name, path = case.lora if case.lora is not None else (None, None)
        assert block_hashes(case.hashed_tokens, case.block_size, algo=algo, seed=seed,
                            cache_salt=case.salt, lora_name=name, lora_path=path,
                            mm_features=case.mm, prompt_embeds=case.prompt_embeds) == ours
        for i in range(len(ours)):
            start, end = i * case.block_size, (i + 1) * case.block_size
            theirs, _ = kcu.generate_block_hash_extra_keys(request, start, end, 0)
            keys, _ = hasher.keys.for_block(start, end)
            assert keys == theirs, (case, i)
            assert [to_event_extra_keys(keys)] == (kcu.to_event_extra_keys([theirs]) or [None])
        for token in case.output:  # decode: vLLM hashes each block as it fills
            request.append_output_token_ids(token)
            ours += hasher.append([token])
        assert ours == vllm_hashes(request), case


def test_default_seed_misses_a_random_xxhash_root(none_hash_state: None) -> None:
    """xxhash_cbor without PYTHONHASHSEED: vLLM draws a random root, so tierd's default seed
    matches nothing; the seed vLLM resolved (get_none_hash_seed) matches."""
    case = random_case(random.Random(1), "plain")
    case.prompt_token_ids = case.hashed_tokens = list(range(4 * case.block_size))
    seed = init_vllm("xxhash_cbor", None)
    request = vllm_request(case, xxhash_cbor)
    theirs = vllm_hashes(request)
    assert tierd_hasher(case, "xxhash_cbor", None).append(case.hashed_tokens)[0] != theirs[0]
    assert tierd_hasher(case, "xxhash_cbor", seed).append(case.hashed_tokens) == theirs


_CHILD = """
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
kcu.init_none_hash(sha256_cbor)
r = Request("r", list(range(48)), SamplingParams(max_tokens=1), None, cache_salt="t",
            lora_request=LoRARequest("l", 1, "/l"),
            block_hasher=kcu.get_request_block_hasher(16, sha256_cbor))
print(",".join(h.hex() for h in r.block_hashes))
"""


@pytest.mark.parametrize("hashseed", [None, "1234"])
def test_fresh_vllm_process_matches(hashseed: str | None) -> None:
    """A fresh vLLM process started with PYTHONHASHSEED unset / set hashes as tierd does with
    its default seed / that seed (no state shared with this process)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                           text=True, check=True, timeout=240)
    ours = block_hashes(range(48), seed=hashseed, cache_salt="t", lora_name="l", lora_path="/l")
    assert child.stdout.strip().splitlines()[-1] == ",".join(h.hex() for h in ours)


def test_contract_is_the_installed_vllm() -> None:
    """The installed vLLM is the release whose contract tierd says it speaks."""
    import vllm

    assert vllm.__version__.startswith(VLLM_HASH_CONTRACT + ".")
