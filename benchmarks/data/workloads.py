"""Deterministic request mixes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Plain English words, so tokenizers see realistic sub-word counts (~1.3 tokens/word).
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "not but first one their also new after they who its two been more other all when during time may "
    "would into only year years can most some three these there later under than over about city world "
    "team people school state season war known county between where used while since both many film "
    "album music government river house north south west east second until during national american "
    "university company following several each game began well family history series group part "
    "village early life including area based same before work end number high another against along "
    "became released due three however day then population became served around called four played "
    "member service home old public great could station line small short long model server request "
    "batch token cache memory network latency answer question customer support price order delivery"
).split()


def mixed_texts(count: int, *, min_words: int = 4, max_words: int = 128, seed: int = 0) -> list[str]:
    """``count`` texts with word counts drawn uniformly from [min_words, max_words]."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


CHAT_PROMPTS = [
    "Explain what a load balancer does in two sentences.",
    "Write a haiku about autumn leaves.",
    "What are three tips for writing clean Python code?",
    "Describe the water cycle briefly.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "List three benefits of regular exercise.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do vaccines work?",
    "Suggest a name for a coffee shop and explain it.",
    "What is machine learning, in simple terms?",
    "Write a polite email declining a meeting invitation.",
    "What causes the seasons on Earth?",
    "Give two examples of renewable energy sources.",
    "How does a hash table work?",
]


TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "AzureLLMInferenceTrace_code.csv"
# Attribution for figures made from the trace (CC-BY 4.0).
TRACE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (Azure Public Dataset, CC-BY 4.0); Patel et al., "
    "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024"
)


def trace_requests(count: int, *, rate_per_s: float, tokens_per_word: int = 40, path: Path = TRACE,
                   seed: int = 11) -> tuple[list[float], list[str]]:
    """Arrival offsets and texts from the Azure code trace's first ``count`` requests.

    Time is compressed so the mean rate is ``rate_per_s`` (burst shape kept); each
    request's ContextTokens is scaled down by ``tokens_per_word`` into a word count,
    clipped to 4..128 words, so a 2-core CPU can serve the same length mix's shape.
    """
    import csv
    from datetime import datetime

    with open(path) as handle:
        rows = [row for _, row in zip(range(count), csv.DictReader(handle))]
    stamps = [datetime.fromisoformat(row["TIMESTAMP"][:26]) for row in rows]
    offsets = [(s - stamps[0]).total_seconds() for s in stamps]
    span = offsets[-1] or 1.0
    scale = (len(rows) / rate_per_s) / span
    rng = random.Random(seed)
    texts = []
    for row in rows:
        words = min(128, max(4, int(row["ContextTokens"]) // tokens_per_word))
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(words)))
    return [o * scale for o in offsets], texts


# ---- chat requests shaped by the trace's lengths (the engines scenario) -----------------

# The Azure code trace's prompts (median 1,469, max 7,437 tokens) are divided by 8 so
# the median is ~180 tokens and the longest fit the 2,048-token context with their
# output (the engines scenario's MAX_MODEL_LEN); outputs (median 13, p99 251) are kept
# as they are, capped at 256.
PROMPT_SCALE, OUTPUT_SCALE = 8, 1
PROMPT_TOKENS_BOUNDS = (8, 1024)
OUTPUT_TOKENS_BOUNDS = (4, 256)
# _WORDS's plain words through SmolLM2's tokenizer: about one token each (measured: 929
# nominal tokens -> 929 words -> ~940 tokens with the instruction)
TOKENS_PER_WORD = 1.0


@dataclass(frozen=True)
class ChatRequest:
    prompt: str
    prompt_tokens: int  # nominal: from the trace, scaled
    max_tokens: int


def scale_lengths(context_tokens: int, generated_tokens: int, *, prompt_scale: float = PROMPT_SCALE,
                  output_scale: float = OUTPUT_SCALE, prompt_bounds: tuple[int, int] = PROMPT_TOKENS_BOUNDS,
                  output_bounds: tuple[int, int] = OUTPUT_TOKENS_BOUNDS) -> tuple[int, int]:
    """One trace row's (ContextTokens, GeneratedTokens), scaled down and clipped."""
    prompt = min(prompt_bounds[1], max(prompt_bounds[0], int(round(context_tokens / prompt_scale))))
    output = min(output_bounds[1], max(output_bounds[0], int(round(generated_tokens / output_scale))))
    return prompt, output


def read_trace_lengths(path: Path = TRACE) -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of every row of the Azure trace."""
    import csv

    with open(path) as handle:
        return [(int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in csv.DictReader(handle)]


def sample_lengths(rows: list[tuple[int, int]], count: int, *, seed: int = 23, **scaling) -> list[tuple[int, int]]:
    """``count`` rows drawn at random (seeded, with replacement) from the trace, scaled
    by :func:`scale_lengths`; the joint prompt/output distribution is kept."""
    if not rows:
        raise ValueError("the trace has no rows")
    rng = random.Random(seed)
    return [scale_lengths(*rng.choice(rows), **scaling) for _ in range(count)]


def words_for_tokens(tokens: int, tokens_per_word: float = TOKENS_PER_WORD) -> int:
    return max(1, int(round(tokens / tokens_per_word)))


def chat_requests(lengths: list[tuple[int, int]], *, seed: int = 29,
                  max_tokens_cap: Optional[int] = None) -> list[ChatRequest]:
    """Unique prompts of the given (nominal) token lengths: a short instruction and random
    plain words, so no two requests share more than the instruction."""
    rng = random.Random(seed)
    out = []
    for i, (prompt_tokens, max_tokens) in enumerate(lengths):
        words = " ".join(rng.choice(_WORDS) for _ in range(words_for_tokens(prompt_tokens)))
        prompt = f"Note {i}. Summarize these notes in plain English: {words}"
        out.append(ChatRequest(prompt, prompt_tokens, min(max_tokens, max_tokens_cap or max_tokens)))
    return out
