"""How a replica starts: the time each phase took, and the warm-up calls it answers
before it reports healthy.

A replica is ready when it has answered real calls, not when its constructor returns:
on vLLM the first calls of each shape can still compile or allocate, and a replica that
Serve routes traffic to while it does that serves its first requests slowly. So the
replica answers :func:`warmup_calls` through its own ``infer`` during Serve's first
health check, which Serve awaits before it marks the replica RUNNING and routes to it
(Ray 2.60: ``initialize_and_get_metadata`` ends with ``check_health``).

The phases (seconds): ``process`` from the replica's process start to its constructor
(Ray's worker start and imports), ``load`` resolving the model's files (a GGUF
conversion on first use), ``engine`` starting the runtime (transformers: loading the
weights; vLLM: importing it, then its engine core's start, load, compile and KV-cache
profiling), ``warmup`` the warm-up calls. ``total_s`` is process start to ready, which
the daily-profile policy reads as the model's start-up (``serve_app.scaling``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Iterator, Optional

from serve_app.core.calls import ChatTurn, ClassifyCall, EmbedCall, GenerateCall, ModelCall, SamplingParams

PHASES = ("process", "load", "engine", "warmup")


def process_started_at() -> float:
    """time.time() when this process started (Linux: /proc), else now."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or /proc unreadable: count from the constructor
        return time.time()


@dataclasses.dataclass
class StartupTimes:
    """One replica's start, phase by phase (seconds), and when it became ready."""

    process_started_at: float
    constructed_at: float = dataclasses.field(default_factory=time.time)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    ready_at: Optional[float] = None
    # vLLM's compile cache at start: "reused" (nothing new written), "filled" (this start
    # compiled and wrote it), None where the engine compiles nothing.
    compile_cache: Optional[str] = None
    # Calls the router sent before the warm-up ended. Serve routes to a replica only once
    # its first health check (which runs the warm-up) has passed, so this should stay 0.
    calls_before_ready: int = 0
    # vLLM's engine core process: "preloaded" (forked from the replica's engine process
    # server, its imports done), "spawned: <why>", None for other engines.
    engine_process: Optional[str] = None

    def __post_init__(self) -> None:
        self.phases.setdefault("process", max(0.0, self.constructed_at - self.process_started_at))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - started

    def count_call_before_ready(self) -> bool:
        """Counts a call that arrived before ready; returns whether it was one."""
        if self.ready_at is not None:
            return False
        self.calls_before_ready += 1
        return True

    def ready(self) -> float:
        """Marks the replica ready; returns its start-up, process start to now."""
        self.ready_at = time.time()
        return self.total_s

    @property
    def total_s(self) -> float:
        end = self.ready_at if self.ready_at is not None else time.time()
        return max(0.0, end - self.process_started_at)

    def snapshot(self) -> dict:
        return {
            "ready": self.ready_at is not None,
            "total_s": round(self.total_s, 2) if self.ready_at is not None else None,
            **{f"{name}_s": round(self.phases[name], 2) for name in PHASES if name in self.phases},
            "compile_cache": self.compile_cache,
            "calls_before_ready": self.calls_before_ready,
            "engine_process": self.engine_process,
        }

    def summary(self) -> str:
        phases = ", ".join(f"{name} {self.phases[name]:.1f}s" for name in PHASES if name in self.phases)
        cache = f", compile cache {self.compile_cache}" if self.compile_cache else ""
        process = f", engine core {self.engine_process}" if self.engine_process else ""
        return f"{self.total_s:.1f}s from process start ({phases}{cache}{process})"


# Words of one token each in common vocabularies, so a text of n words is about n tokens.
_WORD = "hello"


def _text(tokens: int) -> str:
    return " ".join([_WORD] * max(1, tokens))


def warmup_lengths(max_input_tokens: int, longest: int = 512) -> list[int]:
    """Prompt lengths in tokens that cover the shapes a replica will see: powers of four
    from 4 up to the context window (less room for special tokens), at most ``longest``."""
    ceiling = max(4, min(longest, max_input_tokens - 16))
    lengths, n = [], 4
    while n < ceiling:
        lengths.append(n)
        n *= 4
    return lengths + [ceiling]


def warmup_calls(task: str, max_input_tokens: int, max_batch_size: int, *, chat: bool = False,
                 engine_ran_shapes: bool = False) -> list[ModelCall]:
    """The calls a new replica answers before it reports healthy: each length of
    :func:`warmup_lengths` alone, then a batch of mixed lengths as wide as the batch the
    replica runs (at most 32 rows), so the engine has run every step shape it will
    meet. Generation asks for a few greedy tokens (decode steps at each batch width).

    ``engine_ran_shapes``: the engine ran its own step shapes while it started (vLLM's
    dummy runs over its token budget, on a graph compiled for any size), so generation
    sends one short prompt, and a chat turn where there is a template, to run our path
    and the engine's request path once. On 2 cores the full set took 5.5 s of a
    39 s SmolLM2 start and the first requests after it ran no faster than without
    (docs/engines.md, "What the warm-up buys")."""
    greedy = SamplingParams(temperature=0.0)
    chat_turn = [GenerateCall(max_tokens=4, sampling=greedy, messages=(ChatTurn(role="user", content="Hello"),))]
    if task == "text-generation" and engine_ran_shapes:
        return [GenerateCall(max_tokens=4, sampling=greedy, prompts=(_text(8),)), *(chat_turn if chat else ())]
    lengths = warmup_lengths(max_input_tokens)
    width = max(1, min(32, max_batch_size))
    mixed = tuple(_text(lengths[i % len(lengths)]) for i in range(width))
    if task == "embedding":
        return [EmbedCall(texts=(_text(n),)) for n in lengths] + [EmbedCall(texts=mixed)]
    if task == "text-classification":
        return [ClassifyCall(texts=(_text(n),)) for n in lengths] + [ClassifyCall(texts=mixed)]
    if task == "image-classification":
        return [ClassifyCall(images=(_blank_png(),))]
    if task == "text-generation":
        # A short output: the prompt plus it must fit the context window.
        calls: list[ModelCall] = [GenerateCall(max_tokens=4, sampling=greedy, prompts=(_text(n // 2),)) for n in lengths]
        calls.append(GenerateCall(max_tokens=8, sampling=greedy, prompts=tuple(_text(len(t.split()) // 2) for t in mixed)))
        return calls + (chat_turn if chat else [])
    return []


def _blank_png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (127, 127, 127)).save(buffer, format="PNG")
    return buffer.getvalue()


def directory_bytes(path: Optional[str]) -> Optional[int]:
    """Total size of the files under ``path`` (None if it does not exist)."""
    if not path or not os.path.isdir(path):
        return None
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total
