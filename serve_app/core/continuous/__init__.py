"""Continuous (iteration-level) batching for causal LM text generation.

:class:`ContinuousBatcher` runs one decoding loop over a changing set of rows: a
request joins the running batch between two decode steps and leaves it as soon as it
ends, instead of waiting for the longest row of a static batch (which is what
:meth:`~serve_app.core.models.GenerationRuntime.generate` does). Each row streams its
text as it grows.

Threads. ``submit``, ``cancel``, ``stats`` and ``shutdown`` may be called from any
thread (an asyncio event loop, typically). Everything that touches the model (``step``)
runs on one engine thread, started with :meth:`ContinuousBatcher.start` (or a thread of
yours running :meth:`ContinuousBatcher.run_forever`), which sleeps on a condition
variable while there is no work. A request's :class:`GenerationSink` is called on the
engine thread, never while the batcher's lock is held.

One step (:meth:`ContinuousBatcher.step`):

1. rows cancelled since the last step leave the batch (finish_reason "cancelled");
2. waiting rows are admitted first come, first served while the batch has fewer than
   ``max_rows`` rows and the cache the batch can come to allocate stays within
   ``kv_token_budget`` slots (see "Memory" below; a single row larger than the whole
   budget still runs, alone, rather than starving);
3. the admitted rows are prefilled together as their own left-padded batch, which
   yields their first token, and their cache is merged into the running one, as one
   transaction (see "Errors" below);
4. one decode step runs for all rows, each sampling with its own parameters after the
   model's own logits processors (its ``generation_config``: repetition_penalty and the
   like, as the static engine's ``generate()`` applies them);
5. rows that ended (EOS, stop string, max_tokens, context window, cancelled) leave:
   their rows are cut out of every layer's keys and values, and the cache columns that
   only padding still uses are trimmed, so the cache never grows beyond the longest
   running row.

The batch is a plain transformers ``DynamicCache`` with left padding: all rows end at
the same cache column, padding is masked out with the attention mask, and each row gets
explicit ``position_ids`` (its count of real tokens so far), so a row's positions, and
its greedy tokens, are the ones it would get alone. transformers' own continuous
batching (``init_continuous_batching``, paged cache; 5.24 tried) runs on CPU and can
stream and cancel, but it has no stop strings and no per-request seed, its defaults
size the paged cache for the machine's memory (3 small requests took 14 s against 4 s
with generate()), and tuned it was still slower than this loop on SmolLM2-135M with
16 requests (57 against 72 tokens/s); hence this loop.

Memory. Left padding makes the cache rows x (longest running row) slots: one long row
beside many short ones pads all of them to its width. So admission charges that padded
footprint: a row joins only while the most slots the batch with it could come to hold,
every row running to its limit, stays within the budget
(:func:`~serve_app.core.continuous.kv_cache.peak_slots`). Short rows still join beside a long one
if they end before it grows wide; rows that end early only lower the peak. The stats'
``kv_tokens_reserved`` is that bound, ``kv_cache_slots`` what is allocated now. For the
length of one merge, the joining rows' prefill cache and one layer's old tensors come on top.

Errors. Each row ends exactly once (:meth:`ContinuousBatcher._end`), with a result or an
exception. A failed prefill, first-token sampling or merge fails the joining rows only,
before they streamed anything (the merge puts the running cache back if a layer fails:
:func:`~serve_app.core.continuous.kv_cache.append_rows`). A failed decode step, or a failure to cut
finished rows out, fails the running rows and drops the batch; a row whose text fails
to decode fails alone; anything else that escapes a step fails every row it held. The
reservation is computed from the running rows, never counted up and down, so it cannot
leak; the engine goes on with later requests.

The package: ``engine`` (the batcher's loop), ``rows`` (one request's state in it),
``types`` (what callers hold: handles, sinks, stats) and ``kv_cache`` (the cache's row
surgery and the admission bound). It must never import ray.
"""
