"""The continuous batcher's loop: :class:`ContinuousBatcher` (see the package docstring
for its steps, memory bound and error rules). This module must never import ray."""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections import deque

import torch

from serve_app.core.continuous import kv_cache
from serve_app.core.calls import SamplingParams
from serve_app.core.continuous.types import BatcherClosedError, BatcherStats, GenerationSink, RowHandle
from serve_app.core.models import GenerationRequest, GenerationResult, GenerationRuntime
from serve_app.core.continuous.rows import BatchRow
from serve_app.core.decoding.sampling import ModelProcessors, sample
from serve_app.core.decoding.streaming import TextStream

logger = logging.getLogger(__name__)

# The idle engine thread wakes on submit() and shutdown(); this bound only matters for
# a stop_event set by someone else, who cannot notify the condition variable.
_IDLE_WAIT_S = 1.0


class ContinuousBatcher:
    """Iteration-level batching over one :class:`GenerationRuntime`; see the module docstring.

    ``max_rows`` caps the rows decoded together; ``kv_token_budget`` caps the cache
    slots (rows x columns, the left padding included) the running rows can come to
    hold, each row growing to ``prompt_tokens + max_tokens`` columns; a row alone may
    exceed it.

    Raises ValueError for a model whose cache layout cannot be merged (sliding
    window), that takes no ``position_ids``, or whose generation_config cannot be
    turned into logits processors here: the static engine serves those.
    """

    def __init__(self, runtime: GenerationRuntime, *, max_rows: int, kv_token_budget: int):
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}; it must be at least 1")
        if kv_token_budget < 1:
            raise ValueError(f"kv_token_budget={kv_token_budget}; it must be at least 1")
        self.runtime = runtime
        self.model = runtime.model
        self.device = runtime.device
        self.max_rows = max_rows
        self.kv_token_budget = kv_token_budget
        forward_params = inspect.signature(self.model.forward).parameters
        if "position_ids" not in forward_params:
            raise ValueError(f"{type(self.model).__name__}.forward takes no position_ids; continuous batching "
                             "needs them to give left-padded rows their own positions")
        # transformers 5.x renamed past_key_values to cache; accept both spellings.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in forward_params
        kv_cache.check_cache_layout(self.model)
        self._model_processors = ModelProcessors(self.model, runtime.decoding_kwargs(), self.device)

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified on submit, cancel and shutdown
        self._waiting: deque[BatchRow] = deque()
        self._ids = itertools.count(1)
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stepping = threading.Lock()  # step() is for one thread at a time

        # Engine-thread state: the running batch. Row i of every tensor is _active[i].
        self._active: list[BatchRow] = []
        self._cache = None  # transformers DynamicCache, or None while no row runs
        self._mask: torch.Tensor | None = None  # [rows, cache columns], 1 = real token
        self._joining: list[BatchRow] = []  # admitted this step, not yet merged into the batch

        # Counters, updated under _lock so that stats() is consistent.
        self._steps = 0
        self._rows_submitted = 0
        self._rows_admitted = 0
        self._rows_finished = 0
        self._rows_cancelled = 0
        self._rows_failed = 0
        self._tokens_generated = 0
        self._kv_reserved = 0  # kv_cache.peak_slots of the running (and joining) rows

    # ------------------------------------------------------------------ public, any thread

    def submit(self, request: GenerationRequest, params: SamplingParams, sink: GenerationSink) -> RowHandle:
        """Queue one request; thread-safe. Its output goes to ``sink`` from the engine thread.

        Raises ValueError for an empty prompt or max_tokens < 1, and
        :class:`BatcherClosedError` after :meth:`shutdown`.
        """
        if not request.prompt_ids:
            raise ValueError("request has an empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request has max_tokens={request.max_tokens}; it must be at least 1")
        room = self.runtime.max_input_tokens - len(request.prompt_ids)
        limit = max(1, min(request.max_tokens, room))
        handle = RowHandle(request_id=next(self._ids), prompt_tokens=len(request.prompt_ids),
                           submitted_at=time.monotonic())
        stream = TextStream(self.runtime._decode, request.stop)
        row = BatchRow(handle, request, params, sink, limit, stream, self.device)
        with self._lock:
            if self._closed:
                raise BatcherClosedError("the continuous batcher is shut down")
            self._waiting.append(row)
            self._rows_submitted += 1
            self._work.notify()
        return handle

    def cancel(self, handle: RowHandle) -> None:
        """Ask for a request to end; thread-safe. It leaves at the next step as "cancelled".

        Cancelling a finished request does nothing.
        """
        with self._lock:
            handle.cancel_requested = True
            self._work.notify()

    def stats(self) -> BatcherStats:
        """The counters, read together; thread-safe."""
        with self._lock:
            slots = int(self._mask.numel()) if self._mask is not None else 0
            return BatcherStats(
                steps=self._steps, rows_submitted=self._rows_submitted, rows_admitted=self._rows_admitted,
                rows_finished=self._rows_finished, rows_cancelled=self._rows_cancelled,
                rows_failed=self._rows_failed, tokens_generated=self._tokens_generated,
                active_rows=len(self._active), waiting_rows=len(self._waiting),
                kv_tokens_reserved=self._kv_reserved, kv_cache_slots=slots,
            )

    def start(self) -> None:
        """Start the engine thread (a daemon) unless it runs already."""
        with self._lock:
            if self._closed:
                raise BatcherClosedError("the continuous batcher is shut down")
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self.run_forever, args=(self._stop,),
                                            name="continuous-batcher", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop accepting requests, stop the engine thread, fail what is still pending; thread-safe.

        Rows still waiting or running end with :class:`BatcherClosedError` in their
        sink's ``on_finish``. Blocks up to ``timeout`` seconds for the current step.
        Called from a sink (on the engine thread), it returns at once and the engine
        thread ends the pending rows once its step is over.
        """
        with self._lock:
            self._closed = True
            self._stop.set()
            self._work.notify_all()
            thread = self._thread
        if thread is threading.current_thread():
            return
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("continuous batcher thread did not stop within %s s; its rows stay with it", timeout)
                return
        self._fail_pending()

    def _fail_pending(self) -> None:
        error = BatcherClosedError("the continuous batcher shut down before this request finished")
        with self._lock:
            pending = list(self._waiting)
            self._waiting.clear()
        with self._stepping:
            running = self._active
            self._set_batch([], None, None)
        for row in pending + running:
            self._fail(row, error)

    # ------------------------------------------------------------------ engine thread

    def run_forever(self, stop_event: threading.Event) -> None:
        """Run steps until ``stop_event`` is set or :meth:`shutdown` is called, sleeping while idle.

        Rows still queued when ``stop_event`` stops the loop stay queued (another
        run_forever() may serve them); after shutdown() they are failed.
        """
        def stopping() -> bool:
            return stop_event.is_set() or self._stop.is_set()

        while not stopping():
            with self._work:
                while not stopping() and not self._waiting and not self._active:
                    self._work.wait(timeout=_IDLE_WAIT_S)
            if stopping():
                break
            try:
                self.step()
            except Exception:  # step() already ended the rows it hit; keep serving the others
                logger.exception("continuous batcher step failed")
        if self._closed:  # e.g. shutdown() was called from a sink on this thread: finish its work
            self._fail_pending()

    def step(self) -> bool:
        """Run one iteration (see the module docstring); False if there was nothing to do.

        Call it from one thread only: the engine thread, or a test driving the batcher
        by hand without start(). Model errors end the rows they hit (their sink gets
        the exception) and are not raised; an error the step does not expect ends
        every row it held and is raised (run_forever logs it and goes on).
        """
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("ContinuousBatcher.step() is already running in another thread")
        try:
            with torch.inference_mode():
                return self._step()
        except BaseException as exc:
            # Whatever escaped the step's own handling left its rows in an unknown
            # state: end each of them (with this error) rather than leave a client
            # waiting for a row that no step will run again.
            self._abandon(exc)
            raise
        finally:
            self._stepping.release()

    def _abandon(self, error: BaseException) -> None:
        """Fail every row the step held (running or joining) that has not ended, and drop the batch."""
        rows = list(self._joining) + [r for r in self._active if r not in self._joining]
        self._set_batch([], None, None)
        with self._lock:
            self._joining = []
            self._kv_reserved = 0
        for row in rows:
            if not row.ended:
                self._fail(row, error)

    def _step(self) -> bool:
        with self._lock:
            dropped = [r for r in self._waiting if r.handle.cancel_requested]
            for row in dropped:
                self._waiting.remove(row)
        for row in dropped:
            self._finish(row, "cancelled")
        leaving = [r for r in self._active if r.handle.cancel_requested or r.sink_failed]
        if leaving:
            for row in leaving:
                self._finish(row, "cancelled")
            self._keep_rows([i for i, r in enumerate(self._active) if not r.ended])

        admitted = self._admit()
        if not admitted and not self._active:
            return bool(dropped or leaving)
        if admitted:
            self._prefill(admitted)
        if self._active:
            self._decode()
        with self._lock:
            self._steps += 1
        return True

    def _admit(self) -> list[BatchRow]:
        """Take waiting rows, first come first served, while they fit the row and KV budgets.

        A row is charged what the batch would allocate with it (rows x padded width,
        up to every row's limit), not its own tokens: see the module docstring.
        """
        admitted: list[BatchRow] = []
        now = time.monotonic()
        with self._lock:
            # Joining from the moment a row leaves the queue: should anything below raise,
            # the step's failure path ends the rows popped so far instead of losing them.
            self._joining = admitted
            batch = [(r.cached_len, r.kv_cost) for r in self._active]
            while self._waiting and len(self._active) + len(admitted) < self.max_rows:
                row = self._waiting[0]
                # Prefill leaves a joining row holding its prompt.
                candidate = batch + [(len(row.request.prompt_ids), row.kv_cost)]
                if batch and kv_cache.peak_slots(candidate) > self.kv_token_budget:
                    break  # the head waits for room; later rows do not overtake it
                self._waiting.popleft()
                admitted.append(row)
                batch = candidate
                row.handle.admitted_at = now
                self._rows_admitted += 1
            self._kv_reserved = kv_cache.peak_slots(batch)
        return admitted

    def _prefill(self, rows: list[BatchRow]) -> None:
        """Run the new rows' prompts as one left-padded batch and merge them into the running batch.

        One transaction: until the merge is done nothing is streamed and the running
        batch is untouched, so a failure anywhere (an out-of-memory in the forward or in
        the merge's concatenations) fails the joining rows alone, before any of them sent
        a token; the running rows go on.
        """
        try:
            try:
                cache, mask, tokens = self._prefill_forward(rows)
                for row in rows:
                    row.cached_len = len(row.request.prompt_ids)
                deltas = [self._take(row, token) for row, token in zip(rows, tokens)]
                keep = [i for i, r in enumerate(rows) if r.finish_reason is None]
                if keep:
                    if len(keep) < len(rows):  # the prefill cache is ours alone: a failure here touches no one else
                        cache, mask = kv_cache.select_rows(cache, mask, keep)
                    self._merge(cache, mask, [rows[i] for i in keep])
            except Exception as exc:
                logger.exception("prefill of %d new row(s) failed", len(rows))
                for row in rows:
                    self._fail(row, exc)
                return
            # Committed: the rows are in the batch (or ended at their first token).
            now = time.monotonic()
            for row, delta in zip(rows, deltas):
                row.handle.first_token_at = now
                row.deliver(delta)
            for row in rows:
                if row.finish_reason is not None:
                    self._finish(row, row.finish_reason)
        finally:
            with self._lock:
                self._joining = []
                self._kv_reserved = self._peak_slots(self._active)

    def _prefill_forward(self, rows: list[BatchRow]):
        """The new rows' own left-padded cache and mask, and each row's first token."""
        from transformers import DynamicCache

        width = max(len(r.request.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.runtime.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.request.prompt_ids)
            ids[i, width - n:] = torch.tensor(row.request.prompt_ids, dtype=torch.long)
            mask[i, width - n:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        for i, row in enumerate(rows):
            row.processors = self._model_processors.for_row(ids[i, width - len(row.request.prompt_ids):], row.limit)
        # The same positions transformers' generate() gives a left-padded prompt.
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)
        return cache, mask, self._sample(logits, rows)

    def _decode(self) -> None:
        """One token for every running row."""
        rows = self._active
        try:
            ids = torch.tensor([[r.next_token] for r in rows], dtype=torch.long, device=self.device)
            positions = torch.tensor([[r.cached_len] for r in rows], dtype=torch.long, device=self.device)
            mask = torch.cat([self._mask, self._mask.new_ones((len(rows), 1))], dim=1)
            logits = self._forward(ids, mask, positions, self._cache)
            tokens = self._sample(logits, rows)
        except Exception as exc:
            # The cache may hold a half-updated step: drop the whole batch.
            logger.exception("decode step over %d row(s) failed", len(rows))
            self._set_batch([], None, None)
            for row in rows:
                self._fail(row, exc)
            return
        for row in rows:
            row.cached_len += 1
        self._set_batch(rows, self._cache, mask)
        failed: dict[int, Exception] = {}
        for i, (row, token) in enumerate(zip(rows, tokens)):
            try:
                self._accept(row, token)
            except Exception as exc:  # e.g. its text failed to decode: only this row is in doubt
                logger.exception("request %d: recording its token failed", row.handle.request_id)
                failed[i] = exc
        keep = []
        for i, row in enumerate(rows):
            if i in failed:
                self._fail(row, failed[i])
            elif row.finish_reason is not None:
                self._finish(row, row.finish_reason)
            else:
                keep.append(i)
        self._keep_rows(keep)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Last-position logits (float32, [rows, vocab]); the cache grows by ids' width."""
        kwargs = {self._cache_kwarg: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    def _sample(self, logits: torch.Tensor, rows: list[BatchRow]) -> list[int]:
        """One token per row: the model's logits processors first (the row's own, on its
        own ids, so its tokens are those it would get alone), then argmax for greedy
        rows; temperature, top-p and the row's generator otherwise. That is the static
        engine's order too: generate()'s processors, then its sampler."""
        # Row by row, each on its own ids: in a padded batch the processors would see the
        # padding (a repetition penalty would penalise the pad token in short rows only).
        # Only rows of a model whose generation_config asks for processors pay for this.
        for i, row in enumerate(rows):
            if row.processors is not None:
                logits[i:i + 1] = row.processors(logits[i:i + 1])
        return sample(logits, [r.temperature for r in rows], [r.top_p for r in rows], [r.generator for r in rows])

    def _accept(self, row: BatchRow, token: int) -> None:
        """Record a sampled token, stream its text, and decide whether the row ends."""
        row.deliver(self._take(row, token))

    def _take(self, row: BatchRow, token: int) -> str:
        """Record a sampled token and decide whether the row ends; return its new text, not yet streamed."""
        return row.take(token, self.runtime.eos_token_ids)

    def _merge(self, cache, mask: torch.Tensor, rows: list[BatchRow]) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter cache.

        All or nothing: if it raises, the running batch (rows, cache, mask) is as it was.
        """
        if not self._active:
            self._set_batch(list(rows), cache, mask)
            return
        merged, merged_mask = kv_cache.append_rows(self._cache, self._mask, cache, mask)
        self._set_batch(self._active + list(rows), merged, merged_mask)

    def _keep_rows(self, keep: list[int]) -> None:
        """Shrink the running batch to the rows at ``keep`` (its finished rows, already ended, leave)."""
        if not keep:
            self._set_batch([], None, None)
            return
        if len(keep) == len(self._active):
            return
        survivors = [self._active[i] for i in keep]
        try:
            cache, mask = kv_cache.select_rows(self._cache, self._mask, keep)
        except Exception as exc:
            # Some layers may have lost rows already: the cache is no longer one batch.
            # Fail the rows still running (the finished ones have ended) and start over.
            logger.exception("cutting finished rows out of the cache failed; failing the %d row(s) still running",
                             len(survivors))
            self._set_batch([], None, None)
            for row in survivors:
                self._fail(row, exc)
            return
        self._set_batch(survivors, cache, mask)

    def _set_batch(self, active: list[BatchRow], cache, mask: torch.Tensor | None) -> None:
        """Replace the running batch; under the lock so that stats() sees rows and cache agree."""
        reserved = self._peak_slots(active + [r for r in self._joining if not r.ended and r not in active])
        with self._lock:
            self._active, self._cache, self._mask = active, cache, mask
            self._kv_reserved = reserved

    @staticmethod
    def _peak_slots(rows: list[BatchRow]) -> int:
        return kv_cache.peak_slots((max(r.cached_len, len(r.request.prompt_ids)), r.kv_cost) for r in rows)

    # ------------------------------------------------------------------ delivering

    def _finish(self, row: BatchRow, reason: str) -> None:
        """End a row with a result: flush its held-back text, tell its sink."""
        if row.ended:
            return
        try:
            row.finish_reason = reason
            row.deliver(row.stream.finish())
            handle = row.handle
            result = GenerationResult(
                text=row.stream.text, token_ids=list(row.tokens), finish_reason=reason,
                prompt_tokens=handle.prompt_tokens, completion_tokens=len(row.tokens),
                time_to_first_token_s=handle.time_to_first_token_s if row.tokens else None,
            )
        except Exception as exc:  # its text failed to decode: it still ends, with the error
            logger.exception("request %d: building its result failed", row.handle.request_id)
            self._fail(row, exc)
            return
        self._end(row, result)

    def _fail(self, row: BatchRow, error: BaseException) -> None:
        """End a row with an exception instead of a result."""
        if row.ended:
            return
        row.finish_reason = "error"
        self._end(row, error)

    def _end(self, row: BatchRow, outcome: GenerationResult | BaseException) -> None:
        """The one place a row ends: counted once, its sink told once."""
        if row.ended:
            logger.error("request %d already ended; not ending it again", row.handle.request_id)
            return
        row.ended = True
        row.handle.finished_at = time.monotonic()
        failed = isinstance(outcome, BaseException)
        with self._lock:
            self._rows_finished += 1
            self._rows_failed += failed
            self._rows_cancelled += (not failed) and outcome.finish_reason == "cancelled"
            self._tokens_generated += len(row.tokens)
        try:
            row.sink.on_finish(outcome)
        except Exception:
            logger.exception("sink.on_finish failed for request %d", row.handle.request_id)

