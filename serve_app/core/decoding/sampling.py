"""Choosing each row's next token, the same way in both transformers engines.

The model's own logits processors first (its ``generation_config``: repetition_penalty
and the like), then temperature and top-p, drawn with the row's own random generator,
so a seeded row's tokens do not depend on the rows beside it. The static engine runs
this inside ``generate()`` (:class:`~serve_app.core.models.generation.GenerationRuntime`),
the continuous engine row by row (:class:`~serve_app.core.continuous.engine.ContinuousBatcher`).

This module must never import ray.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A random generator of its own: seeded with ``seed``, or freshly at random."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def top_p_filter(scores: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filtering of ``scores`` [rows, vocab] as transformers' TopPLogitsWarper
    does it; ``top_p`` is one value or one per row. The most likely token always stays."""
    top_p = torch.as_tensor(top_p, dtype=scores.dtype, device=scores.device).reshape(-1, 1)
    sorted_scores, sorted_index = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def sample(logits: torch.Tensor, temperatures: Sequence[float], top_ps: Sequence[float],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]: argmax where the temperature is 0,
    else temperature, top-p and a draw with the row's generator (None: the global RNG)."""
    chosen = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        scores = logits.index_select(0, index) / torch.tensor(
            [temperatures[i] for i in sampled], device=logits.device)[:, None]
        top_p = torch.tensor([top_ps[i] for i in sampled], device=logits.device)
        if bool((top_p < 1.0).any()):
            scores = top_p_filter(scores, top_p)
        probs = torch.softmax(scores, dim=-1)
        for j, i in enumerate(sampled):
            chosen[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return chosen.tolist()


class RowProcessors:
    """One row's logits processors and the ids they look at: its prompt, then the
    tokens it generated so far (never another row's, nor padding)."""

    __slots__ = ("processors", "ids", "length")

    def __init__(self, processors: Any, prompt: torch.Tensor, limit: int):
        self.processors = processors
        self.ids = torch.empty(prompt.shape[0] + limit, dtype=torch.long, device=prompt.device)
        self.ids[:prompt.shape[0]] = prompt
        self.length = prompt.shape[0]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's logits [1, vocab] after its processors."""
        return self.processors(self.ids[None, :self.length], logits)

    def append(self, token: int) -> None:
        if self.length < self.ids.shape[0]:
            self.ids[self.length] = token
            self.length += 1


class ModelProcessors:
    """The logits processors a model's generation_config asks for, built per row as
    ``generate()`` builds them, from the same decoding arguments (``decoding``: what
    :meth:`GenerationRuntime.decoding_kwargs` gives generate()), through transformers'
    own preparation, so both engines apply the same processors.

    Raises ValueError if this transformers has no such preparation: the static engine
    then serves the model rather than the continuous one ignoring its generation_config.
    """

    def __init__(self, model: Any, decoding: dict, device: torch.device):
        self.model = model
        self.device = device
        try:
            config, _ = model._prepare_generation_config(None, max_new_tokens=1, **decoding)
            model._prepare_special_tokens(config, True, device=device)
            if not callable(getattr(model, "_get_logits_processor", None)):  # used per row
                raise AttributeError("no _get_logits_processor")
        except (AttributeError, TypeError) as exc:
            raise ValueError(f"cannot build {type(model).__name__}'s logits processors from its "
                             f"generation_config with this transformers ({exc})") from exc
        # generate() turns min_new_tokens=0 into min_length = prompt length, a minimum
        # every row already meets; 0 says the same without a processor that never acts.
        config.min_length = 0
        self.config = config

    def for_row(self, prompt: torch.Tensor, limit: int) -> RowProcessors | None:
        """The processors for a row of ``prompt`` (its ids on the device) and up to
        ``limit`` new tokens; None in the usual case that the config asks for none."""
        from transformers import LogitsProcessorList

        n = prompt.shape[0]
        config = copy.copy(self.config)
        config.max_new_tokens = limit
        config.max_length = n + limit  # what generate() derives from max_new_tokens
        processors = self.model._get_logits_processor(
            generation_config=config, input_ids_seq_length=n, encoder_input_ids=prompt[None, :],
            prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=self.device,
            model_kwargs={},
        )
        return RowProcessors(processors, prompt, limit) if len(processors) else None
