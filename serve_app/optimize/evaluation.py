"""The quality gate: task-level figures of a cheaper variant against the full-precision
model on the evaluation set that ships with the package, and the floor it must meet.

The set (``data/eval_chat.jsonl``, ``data/eval_pairs.tsv``, written for this project):

- chat: prompts, some with the word a right answer contains. Figures:
  ``greedy_agreement``, the share of the reference's greedy answer tokens that the
  candidate also picks when it reads the same answer so far (teacher-forced, so one
  early difference does not count every later token twice); ``answers_identical``, the
  share of prompts whose whole greedy answer is the same; ``answers_correct_*``, the
  share of answers that contain the expected word, for both models.
- embeddings: query/passage pairs. ``retrieval_accuracy_*``: the share of queries whose
  nearest passage (cosine) is their own, for both models.

With :mod:`serve_app.optimize.quality`'s next-token agreement, perplexity and cosine on
held-out text, these are what :class:`QualityFloor` checks.

This module must never import ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

import torch

from serve_app.core.models import EmbeddingRuntime, GenerationRuntime, TaskRuntime
from serve_app.core.calls import SamplingParams
from serve_app.core.models.generation import GenerationRequest, encode_chat_template

#: New tokens of each greedy answer compared.
ANSWER_TOKENS = 24


@dataclass(frozen=True)
class ChatItem:
    prompt: str
    expect: str  # a word a right answer contains; "" for open prompts


def chat_items() -> list[ChatItem]:
    text = resources.files("serve_app.optimize").joinpath("data", "eval_chat.jsonl").read_text(encoding="utf-8")
    return [ChatItem(**json.loads(line)) for line in text.splitlines() if line.strip()]


def retrieval_pairs() -> list[tuple[str, str]]:
    text = resources.files("serve_app.optimize").joinpath("data", "eval_pairs.tsv").read_text(encoding="utf-8")
    pairs = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            query, passage = line.split("\t")
            pairs.append((query.strip(), passage.strip()))
    return pairs


# --------------------------------------------------------------------------- chat


def _prompt_ids(runtime: GenerationRuntime, prompt: str) -> list[int]:
    if getattr(runtime.tokenizer, "chat_template", None):
        return encode_chat_template(runtime.tokenizer, [{"role": "user", "content": prompt}])
    return runtime.tokenizer(prompt).input_ids


#: Prompts generated (and teacher-forced) together, in one left-padded generate() per
#: group instead of one per prompt. SmolLM2's 24-token answers in fp32 on a 2-core AVX2
#: EPYC took 0.95 s per prompt one at a time, 0.38 s in groups of 8, 0.21 s all 24
#: together (in emulated bf16, about 0.9 s each way: batching pays where bf16 is native,
#: which is where the precision gate runs). The set's prompts and answers are short
#: (under 70 tokens), so a group of 32 costs little memory even for a large model.
BATCH_PROMPTS = 32


def _greedy_answers(runtime: GenerationRuntime, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer, as the runtime serves it (left-padded rows with their
    attention masks, each ending at its own EOS)."""
    requests = [GenerationRequest(prompt_ids=ids, max_tokens=new_tokens) for ids in prompts]
    return [result.token_ids for result in runtime.generate(requests, SamplingParams(temperature=0.0))]


def _forced_choices(runtime: GenerationRuntime, prompts: Sequence[list[int]],
                    answers: Sequence[list[int]]) -> list[list[int]]:
    """The model's top token at each answer position, having read the answer so far, for
    every (prompt, answer) row in one forward pass (right-padded: causal attention keeps
    the padding out of every real position)."""
    rows = [ids + answer for ids, answer in zip(prompts, answers)]
    width = max(len(row) for row in rows)
    inputs = torch.full((len(rows), width), runtime.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(inputs)
    for i, row in enumerate(rows):
        inputs[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    with torch.inference_mode():
        top = runtime.model(input_ids=inputs.to(runtime.device), attention_mask=mask.to(runtime.device)
                            ).logits.argmax(dim=-1).cpu()
    return [top[i, len(ids) - 1: len(ids) - 1 + len(answer)].tolist()
            for i, (ids, answer) in enumerate(zip(prompts, answers))]


def chat_agreement(reference: GenerationRuntime, candidate: GenerationRuntime, items: Sequence[ChatItem],
                   new_tokens: int = ANSWER_TOKENS, batch_prompts: int = BATCH_PROMPTS) -> dict[str, Any]:
    agreed = compared = identical = 0
    correct = {"reference": 0, "candidate": 0}
    graded = 0
    prompts = [_prompt_ids(reference, item.prompt) for item in items]
    # Prompts of like length share a group, so rows carry little padding.
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_prompts):
        group = order[start:start + batch_prompts]
        ids = [prompts[i] for i in group]
        answers = {"reference": _greedy_answers(reference, ids, new_tokens),
                   "candidate": _greedy_answers(candidate, ids, new_tokens)}
        forced = [(p, a) for p, a in zip(ids, answers["reference"]) if a]
        if forced:
            choices = _forced_choices(candidate, [p for p, _ in forced], [a for _, a in forced])
            for chosen, (_, answer) in zip(choices, forced):
                agreed += sum(a == b for a, b in zip(chosen, answer))
                compared += len(answer)
        for row, i in enumerate(group):
            identical += answers["reference"][row] == answers["candidate"][row]
            if items[i].expect:
                graded += 1
                for name in answers:
                    text = reference.tokenizer.decode(answers[name][row], skip_special_tokens=True)
                    correct[name] += items[i].expect.lower() in text.lower()
    return {
        "prompts": len(items), "answer_tokens": new_tokens,
        "greedy_agreement": round(agreed / compared, 4) if compared else None,
        "answers_identical": round(identical / len(items), 4) if items else None,
        "answers_correct_reference": round(correct["reference"] / graded, 4) if graded else None,
        "answers_correct_candidate": round(correct["candidate"] / graded, 4) if graded else None,
    }


# --------------------------------------------------------------------------- embeddings


def _top1(runtime: EmbeddingRuntime, pairs: Sequence[tuple[str, str]]) -> float:
    queries = torch.tensor(runtime.embed([runtime.tokenize(q) for q, _ in pairs]))
    passages = torch.tensor(runtime.embed([runtime.tokenize(p) for _, p in pairs]))
    nearest = (queries @ passages.T).argmax(dim=-1)  # both are L2-normalized
    return float((nearest == torch.arange(len(pairs))).float().mean())


def retrieval_agreement(reference: EmbeddingRuntime, candidate: EmbeddingRuntime,
                        pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {"pairs": len(pairs), "retrieval_accuracy_reference": round(_top1(reference, pairs), 4),
            "retrieval_accuracy_candidate": round(_top1(candidate, pairs), 4)}


def task_evaluation(reference: TaskRuntime, candidate: TaskRuntime) -> dict[str, Any]:
    """The evaluation set's figures for the task (empty for tasks it has none for)."""
    if isinstance(reference, GenerationRuntime):
        return chat_agreement(reference, candidate, chat_items())
    if isinstance(reference, EmbeddingRuntime):
        return retrieval_agreement(reference, candidate, retrieval_pairs())
    return {}


# --------------------------------------------------------------------------- the floor


@dataclass(frozen=True)
class QualityFloor:
    """What a cheaper variant must keep of the full-precision model's quality."""

    min_greedy_agreement: float = 0.9
    max_perplexity_increase: float = 0.05  # relative: 0.05 is perplexity within 5%
    min_cosine: float = 0.99  # mean embedding cosine on held-out text
    max_retrieval_drop: float = 0.0  # retrieval accuracy points the variant may lose
    min_label_agreement: float = 0.98

    def shortfalls(self, quality: dict[str, Any]) -> list[str]:
        """Each figure of ``quality`` (held-out and evaluation-set figures together)
        below the floor, said in words; empty when the variant passes."""
        short = []

        def check(key: str, ok, said: str) -> None:
            value = quality.get(key)
            if value is not None and not ok(value):
                short.append(said.format(value=value))

        check("greedy_agreement", lambda v: v >= self.min_greedy_agreement,
              f"greedy agreement {{value}} < {self.min_greedy_agreement}")
        check("embedding_cosine_mean", lambda v: v >= self.min_cosine,
              f"embedding cosine {{value}} < {self.min_cosine}")
        check("label_agreement", lambda v: v >= self.min_label_agreement,
              f"label agreement {{value}} < {self.min_label_agreement}")
        ref, cand = quality.get("perplexity_reference"), quality.get("perplexity_candidate")
        if ref and cand and cand > ref * (1 + self.max_perplexity_increase):
            short.append(f"perplexity {cand} is {cand / ref - 1:.1%} above {ref} "
                         f"(at most {self.max_perplexity_increase:.0%})")
        ref, cand = quality.get("retrieval_accuracy_reference"), quality.get("retrieval_accuracy_candidate")
        if ref is not None and cand is not None and cand < ref - self.max_retrieval_drop:
            short.append(f"retrieval accuracy {cand} < {ref} of the full-precision model")
        return short
