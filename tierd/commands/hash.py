"""`tierd hash`: print the block-hash chain of a token list, to check interop with vLLM by hand.

    echo 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 | tierd hash
    tierd hash '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]' --json

The tokens come as a JSON array or a comma (or space) separated list, from the argument or, when
it is absent or ``-``, from standard input. Bad input exits with status 2 and says what to fix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from tierd import hashing

HELP = "Print the vLLM-compatible block-hash chain of a token list (JSON or comma list)."

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
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON array (``[1, 2]``) or a comma/space separated list (``1,2``)."""
    text = text.strip()
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
    tokens: list[int] = []
    for word in re.split(r"[,\s]+", text.strip(", ")):
        if not re.fullmatch(r"[+-]?\d+", word):
            raise ValueError(f"{word!r} is not a token id; give integers like 1,2,3")
        tokens.append(int(word))
    return tokens


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.tokens == "-" else args.tokens
    tokens = parse_tokens(text)
    size = args.block_size
    hashes = hashing.block_hashes(
        tokens,
        size,
        algo=args.algo,
        seed=args.seed,
        cache_salt=args.cache_salt,
        lora_name=args.lora_name,
    )
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
            "num_tokens": len(tokens),
            "unhashed_tokens": left,
            "none_hash": root.hex(),
            "blocks": [
                {"index": i, "start": i * size, "end": (i + 1) * size, "hash": h.hex()}
                for i, h in enumerate(hashes)
            ],
        }
        print(json.dumps(report, indent=2))
        return 0
    print(f"algo {args.algo}, block size {size}, seed {seed!r}, {len(tokens)} tokens")
    print(f"none_hash   {root.hex()}")
    for i, h in enumerate(hashes):
        print(f"block {i:<5} {h.hex()}  tokens {i * size}..{(i + 1) * size - 1}")
    if left:
        noun = "token forms" if left == 1 else "tokens form"
        print(f"({left} trailing {noun} a partial block: never hashed)")
    return 0
