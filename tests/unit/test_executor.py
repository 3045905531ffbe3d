"""The model-paced executor: batches that wait while the model is busy merge."""

import asyncio
import threading
import time

import pytest

from serve_app.core.batching.executor import Budget, ModelPacedExecutor


class FakeModel:
    """Records each call's rows; can be held busy until released."""

    def __init__(self, seconds: float = 0.0):
        self.calls: list[list] = []
        self.seconds = seconds
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, rows):
        self.gate.wait(5)
        time.sleep(self.seconds)
        self.calls.append(list(rows))
        return [ValueError(f"bad {r}") if r == "bad" else f"out-{r}" for r in rows]


def _executor(model, max_rows=64, max_tokens=10_000):
    return ModelPacedExecutor(model, budget=lambda: Budget(max_rows, max_tokens), row_tokens=lambda row: 10)


def test_idle_batch_runs_at_once():
    async def main():
        model = FakeModel()
        executor = _executor(model)
        return await asyncio.gather(*executor.submit(["a", "b"])), model

    results, model = asyncio.run(main())
    assert results == ["out-a", "out-b"] and model.calls == [["a", "b"]]


def test_batches_waiting_while_busy_merge_into_one_call():
    async def main():
        model = FakeModel()
        executor = _executor(model)
        model.gate.clear()  # hold the first call on the "GPU"
        first = executor.submit(["first"])
        await asyncio.sleep(0.05)
        later = [executor.submit([f"r{i}"]) for i in range(10)]
        model.gate.set()
        await asyncio.gather(*first, *(f for fs in later for f in fs))
        return model

    model = asyncio.run(main())
    assert model.calls[0] == ["first"]
    assert model.calls[1] == [f"r{i}" for i in range(10)], "waiting batches should merge, oldest first"
    assert len(model.calls) == 2


@pytest.mark.parametrize("max_rows, max_tokens, expected", [(3, 10_000, [3, 3, 3, 1]), (64, 25, [2, 2, 2, 2, 2])])
def test_merged_calls_respect_budget(max_rows, max_tokens, expected):
    async def main():
        model = FakeModel()
        executor = _executor(model, max_rows=max_rows, max_tokens=max_tokens)
        model.gate.clear()
        busy = executor.submit(["busy"])
        await asyncio.sleep(0.05)
        rows = [f"r{i}" for i in range(sum(expected))]
        futures = [f for row in rows for f in executor.submit([row])]
        model.gate.set()
        await asyncio.gather(*busy, *futures)
        return model

    model = asyncio.run(main())
    assert [len(c) for c in model.calls[1:]] == expected


def test_row_error_fails_only_that_row():
    async def main():
        executor = _executor(FakeModel())
        return await asyncio.gather(*executor.submit(["ok", "bad", "fine"]), return_exceptions=True)

    ok, bad, fine = asyncio.run(main())
    assert ok == "out-ok" and fine == "out-fine" and isinstance(bad, ValueError)


def test_cancelled_rows_are_not_computed():
    async def main():
        model = FakeModel()
        executor = _executor(model)
        model.gate.clear()
        busy = executor.submit(["busy"])
        await asyncio.sleep(0.05)
        gone, kept = executor.submit(["gone", "kept"])
        gone.cancel()  # the client went away while waiting
        model.gate.set()
        await asyncio.gather(*busy, kept)
        return model

    assert asyncio.run(main()).calls == [["busy"], ["kept"]]


def test_rows_past_their_deadline_fail_instead_of_running():
    class TooLate(Exception):
        pass

    async def main():
        model = FakeModel()
        late: set[str] = set()
        executor = ModelPacedExecutor(model, budget=lambda: Budget(64, 10_000), row_tokens=lambda row: 10,
                                      expired=lambda row: TooLate(row) if row in late else None)
        model.gate.clear()
        busy = executor.submit(["busy"])
        await asyncio.sleep(0.05)
        stale, fresh = executor.submit(["stale", "fresh"])
        late.add("stale")  # its caller's deadline passes while the model is busy
        model.gate.set()
        await asyncio.gather(*busy, fresh)
        with pytest.raises(TooLate):
            await stale
        return model

    assert asyncio.run(main()).calls == [["busy"], ["fresh"]]


def test_a_crashing_model_call_fails_its_rows_and_the_worker_keeps_going():
    calls = []

    def flaky(rows):
        calls.append(rows)
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return [r.upper() for r in rows]

    async def main():
        executor = ModelPacedExecutor(flaky, budget=lambda: Budget(8, 100), row_tokens=len)
        first = await asyncio.gather(*executor.submit(["x"]), return_exceptions=True)
        second = await asyncio.gather(*executor.submit(["y"]))
        return first, second

    first, second = asyncio.run(main())
    assert isinstance(first[0], RuntimeError) and second == ["Y"]
