"""How many tokens each request of `tierd bench workload` generates.

With exactly as many tokens out for every request, two requests scheduled in the same step
finish in the same step and their clients send the next ones together: a closed-loop run stays
in whichever regime it fell into at its start (hits scheduled one at a time, or two at a time
in a longer step), so two runs of one arm can differ in TTFT p50 by a step.
Here a request ends at the first stop token it generates once it has its least length, or at
its most: every prompt gets a length of its own (greedy decoding: the same in every arm), as a
real workload's replies differ, so requests started together drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.bench.tiny_llama import SPECIAL, VOCAB


@dataclass(frozen=True)
class Output:
    """The output lengths of a run's requests (module doc)."""

    most: int
    """Tokens a request generates at most (its ``max_tokens``)."""
    least: int
    """Tokens it generates before a stop token may end it (vLLM's ``min_tokens``)."""
    stop_every: int
    """Every this-many-th word of the small Llama is a stop token; 0: none, every request
    generates ``most`` tokens."""

    def __post_init__(self) -> None:
        if self.most < 1 or not 0 <= self.least <= self.most or self.stop_every < 0:
            raise ValueError(f"need --output-len >= 1, 0 <= --output-min <= --output-len and "
                             f"--stop-every >= 0, not {self.most}, {self.least}, "
                             f"{self.stop_every}")

    def stop_tokens(self) -> list[int]:
        """The stop tokens' ids: words only (never the tokenizer's special ids)."""
        if self.stop_every == 0 or self.least == self.most:
            return []
        return list(range(len(SPECIAL), VOCAB, self.stop_every))

    def sampling(self) -> dict[str, object]:
        """What every request's body adds to vLLM's sampling parameters (empty: none). The
        stop token stays in the text, so a reply's words are its tokens."""
        stops = self.stop_tokens()
        return {"stop_token_ids": stops, "min_tokens": self.least,
                "include_stop_str_in_output": True} if stops else {}
