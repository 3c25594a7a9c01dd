"""`tierd hash`: print the block-hash chain of a token list, to check interop with vLLM by hand.

    echo 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 | tierd hash
    tierd hash '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]' --json

The tokens come as a JSON array or a comma (or space) separated list, from the argument or, when
it is absent or ``-``, from standard input. Bad input exits with status 2 and says what to fix.
The contract is vLLM 0.33's (``hashing.VLLM_HASH_CONTRACT``): a LoRA block needs both
``--lora-name`` and ``--lora-path``. ``--json`` also prints each block's extra keys, tagged as
they are hashed and untagged as vLLM's KV events publish them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from typing import Any

from tierd import hashing
from tierd.extra_keys import RequestKeys, to_event_extra_keys
from tierd.types import BlockHash

HELP = (
    f"Print the block-hash chain of a token list (JSON or comma list), bit-identical to vLLM "
    f"{hashing.VLLM_HASH_CONTRACT}'s (tagged extra keys; other vLLM releases may differ)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "tokens",
        nargs="?",
        default="-",
        help="token ids as a JSON array or a comma list; omitted or '-': read standard input",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        choices=hashing.BLOCK_SIZES,
        help="tokens per block, as vLLM's --block-size (default 16)",
    )
    parser.add_argument(
        "--algo",
        default="sha256_cbor",
        choices=hashing.HASH_ALGOS,
        help="sha256_cbor (default; vLLM's --prefix-caching-hash-algo sha256_cbor) or "
        "xxhash_cbor (faster, not collision resistant)",
    )
    parser.add_argument(
        "--seed",
        default=None,
        help="NONE_HASH seed (default 'vllm-none-hash'); to match a vLLM started with "
        "PYTHONHASHSEED=S pass --seed S",
    )
    parser.add_argument("--cache-salt", default=None, help="per-tenant salt, folded into block 0")
    parser.add_argument("--lora-name", default=None, help="LoRA adapter name, on every block")
    parser.add_argument(
        "--lora-path",
        default=None,
        help="LoRA adapter path as vLLM was given it (LoRARequest.lora_path); vLLM "
        f"{hashing.VLLM_HASH_CONTRACT} hashes ('lora', name, path), so --lora-name needs it",
    )
    parser.add_argument(
        "--model",
        metavar="DIR_OR_ID",
        default=None,
        help="also print the model id tierd keys these blocks under: of a checkpoint folder "
        "(as an engine running it with its config's dtype derives it) or a model id, checked",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON array (``[1, 2]``) or a comma/space separated list (``1,2``)."""
    text = text.strip()
    if text.isascii() and text.replace(",", "").isdigit():  # "1,2,3": the C JSON decoder
        with contextlib.suppress(json.JSONDecodeError):  # "01" or "1,,2": the checks below
            return list(json.loads(f"[{text}]"))
    if not text:
        raise ValueError("no token ids given; pass e.g. '1,2,3' or '[1, 2, 3]' or pipe them in")
    if text[0] in "[{\"":  # JSON; anything else is a comma or space list
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            fix = f"token list is not valid JSON ({exc}); write e.g. [1, 2, 3]"
            raise ValueError(fix) from None
        # `type(v) is int`: JSON true/false load as bools, which are not token ids.
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise ValueError("the JSON must be an array of integers, e.g. [1, 2, 3]")
        return values
    words = re.split(r"[,\s]+", text.strip(", "))
    for word in words:  # ASCII digits with an optional sign (int() alone takes "1_0", "²")
        digits = word[1:] if word[:1] in ("+", "-") else word
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"{word!r} is not a token id; give integers like 1,2,3")
    return list(map(int, words))


def check_lora(lora_name: str | None, lora_path: str | None) -> None:
    """ValueError unless the LoRA flags come as a pair (vLLM 0.33 hashes name and path)."""
    if (lora_name is None) != (lora_path is None):
        raise ValueError(
            f"give --lora-name and --lora-path together: vLLM {hashing.VLLM_HASH_CONTRACT} "
            "hashes a LoRA block with ('lora', name, path), path as in its LoRARequest"
        )


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.tokens == "-" else args.tokens
    tokens = parse_tokens(text)
    check_lora(args.lora_name, args.lora_path)
    size = args.block_size
    hasher = hashing.BlockHasher(
        size,
        algo=args.algo,
        seed=args.seed,
        cache_salt=args.cache_salt,
        lora_name=args.lora_name,
        lora_path=args.lora_path,
    )
    hashes = hasher.append(tokens)
    model = None
    if args.model is not None:
        from tierd.model_identity import identity_of_argument

        model = identity_of_argument(args.model)
    root = hashing.none_hash(args.seed, args.algo)
    seed = hashing.DEFAULT_SEED if args.seed is None else args.seed
    left = len(tokens) - len(hashes) * size
    if args.json:
        report = {
            "algo": args.algo,
            "block_size": size,
            "seed": seed,
            "cache_salt": args.cache_salt,
            "lora_name": args.lora_name,
            "lora_path": args.lora_path,
            "vllm_hash_contract": hashing.VLLM_HASH_CONTRACT,
            "num_tokens": len(tokens),
            "unhashed_tokens": left,
            "none_hash": root.hex(),
            "blocks": [_block(hasher.keys, i, size, h) for i, h in enumerate(hashes)],
        }
        if model is not None:
            report |= {"model_id": model.model_id, "model_source": model.source}
        print(json.dumps(report, indent=2))
        return 0
    print(f"algo {args.algo}, block size {size}, seed {seed!r}, {len(tokens)} tokens")
    if model is not None:
        print(f"model_id    {model.model_id}  ({model.source})")
    print(f"none_hash   {root.hex()}")
    for i, h in enumerate(hashes):
        print(f"block {i:<5} {h.hex()}  tokens {i * size}..{(i + 1) * size - 1}")
    if left:
        noun = "token forms" if left == 1 else "tokens form"
        print(f"({left} trailing {noun} a partial block: never hashed)")
    return 0


def _block(keys: RequestKeys, index: int, size: int, block_hash: BlockHash) -> dict[str, Any]:
    """One block of the JSON report: its span, hash and extra keys (hashed and event forms)."""
    start, end = index * size, (index + 1) * size
    extra, _ = keys.for_block(start, end)
    return {
        "index": index,
        "start": start,
        "end": end,
        "hash": block_hash.hex(),
        "extra_keys": extra,
        "event_extra_keys": to_event_extra_keys(extra),
    }
