"""Deterministic request mixes."""

from __future__ import annotations

import random
from pathlib import Path

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


TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "AzureLLMInferenceTrace_code.csv"
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
