"""Prefix-affinity routing without Ray's routing loop: the prefix index (chained block
hashes per replica), the text a call is routed by, and when the policy is on. The
router runs over two vLLM replicas in the affinity benchmark
(benchmarks/scenarios/affinity.py, smoke-run by the integration tests)."""

from __future__ import annotations

import pytest

from serve_app.config import ModelConfig
from serve_app.core.calls import ChatTurn, EmbedCall, GenerateCall
from serve_app.core.prefix_index import PrefixIndex, block_hashes
from serve_app.ingress.affinity import affinity_text

SYSTEM = "You answer questions about our garden tools. " * 20  # about 900 characters


def test_block_hashes_chain_so_a_block_stands_for_its_whole_prefix():
    a, b = block_hashes("x" * 8 + "yyyy" + "zz", 4), block_hashes("w" * 4 + "x" * 4 + "yyyy", 4)
    assert len(a) == 3, "the 2-character tail is not a whole block"
    assert a[1] != b[1], "the same block after a different prefix is a different block"
    assert block_hashes("x" * 8 + "yyyy" + "qq", 4) == a


def test_the_index_sends_a_prefix_to_the_replica_that_holds_most_of_it():
    index = PrefixIndex(block_chars=16)
    line_a, line_b = index.hashes("A" * 160 + "question one"), index.hashes("B" * 160 + "question one")
    index.record("r1", line_a)
    index.record("r2", line_b)
    assert index.best(["r1", "r2"], index.hashes("A" * 160 + "another question")) == ("r1", 10)
    assert index.best(["r1", "r2"], index.hashes("B" * 160 + "x" * 40)) == ("r2", 10)
    assert index.best(["r1", "r2"], index.hashes("C" * 160)) == (None, 0)
    assert index.best(["r2"], line_a) == (None, 0), "only the candidates count"


def test_a_new_prefix_goes_where_the_fewest_prefixes_are_and_memory_is_bounded():
    index = PrefixIndex(block_chars=4, max_blocks=5)
    index.record("busy", index.hashes("a" * 16))
    assert index.least_loaded(["busy", "idle"]) == "idle"
    index.record("busy", index.hashes("b" * 16))
    assert index.matched("busy", index.hashes("b" * 16)) == 4
    assert index.matched("busy", index.hashes("a" * 16)) == 0, "the least recently sent blocks went first"
    index.keep_only(["idle"])
    assert index.matched("busy", index.hashes("b" * 16)) == 0


def test_a_call_is_routed_by_its_chat_or_prompt_and_its_adapter():
    chat = GenerateCall(max_tokens=4, messages=(ChatTurn("system", SYSTEM), ChatTurn("user", "How long?")))
    other = GenerateCall(max_tokens=4, messages=(ChatTurn("system", SYSTEM), ChatTurn("user", "Which spade?")))
    shared = affinity_text(chat)[:len(SYSTEM)]
    assert shared == affinity_text(other)[:len(SYSTEM)] and SYSTEM[:100] in shared
    tuned = GenerateCall(max_tokens=4, messages=chat.messages, adapter="garden")
    assert not affinity_text(tuned).startswith(affinity_text(chat)[:10]), "an adapter's prefixes are its own"
    assert affinity_text(GenerateCall(max_tokens=4, prompts=("Once upon",))) == "<>Once upon"
    # No text to match: routed by balance alone.
    assert affinity_text(GenerateCall(max_tokens=4, prompts=((1, 2, 3),))) is None
    assert affinity_text(EmbedCall(texts=("a",))) is None
    assert affinity_text([chat]) is None and affinity_text(None) is None


@pytest.mark.parametrize("model, affinity", [
    ({"task": "text-generation", "num_replicas": 2}, True),
    ({"task": "text-generation", "load_profile": "day"}, True),
    ({"task": "text-generation"}, False),  # one replica: nothing to choose
    ({"task": "text-generation", "num_replicas": 2, "engine": "transformers"}, False),  # no prefix cache
    ({"task": "embedding", "num_replicas": 2}, False),
    ({"task": "text-generation", "routing": {"policy": "prefix_affinity"}}, True),
    ({"task": "text-generation", "num_replicas": 2, "routing": {"policy": "balanced"}}, False),
])
def test_affinity_is_on_by_default_for_generation_models_with_several_replicas(model, affinity):
    assert ModelConfig.model_validate({"name": "m", "source": "/x", **model}).prefix_affinity() is affinity


def test_the_model_deployment_routes_by_prefix_when_affinity_is_on():
    from serve_app.app import model_deployment
    from serve_app.config import parse_app_config

    def router_config(**model):
        config = parse_app_config({"models": [{"name": "m", "source": "/x", "task": "text-generation", **model}]})
        return model_deployment(config.models[0], config)._bound_deployment._deployment_config.request_router_config

    routed = router_config(num_replicas=2, routing={"imbalanced_requests": 3})
    assert routed.request_router_class == "serve_app.ingress.affinity.PrefixAffinityRouter"
    assert routed.request_router_kwargs == {"imbalanced_requests": 3}
    assert "PowerOfTwo" in str(router_config().request_router_class)


class _Replica:
    def __init__(self, name: str):
        self.replica_id = name

    def __repr__(self):
        return self.replica_id


def _router(monkeypatch, queue_lens: dict, imbalanced: int = 8):
    """The router's own decisions, with Serve's parts (power of two, queue probes) faked."""
    import asyncio

    from serve_app.ingress import affinity

    router = object.__new__(affinity.PrefixAffinityRouter)
    router.initialize_state(imbalanced_requests=imbalanced, block_chars=16)
    router._use_replica_queue_len_cache = False

    async def probe(replicas, backoff_index):
        return [(r, queue_lens.get(r.replica_id)) for r in replicas]

    async def power_of_two(self, candidate_replicas, pending_request=None):
        return [list(candidate_replicas)]

    router._probe_queue_lens = probe
    monkeypatch.setattr(affinity.PowerOfTwoChoicesRequestRouter, "choose_replicas", power_of_two)

    def route(replicas, call):
        from types import SimpleNamespace

        request = SimpleNamespace(args=(call,))
        # Serve's default (strict max_ongoing_requests off) never calls on_request_routed:
        # the router learns from its own choices.
        return asyncio.run(router.choose_replicas(replicas, request))

    return router, route


def _line(line: str, question: str) -> GenerateCall:
    return GenerateCall(max_tokens=4, messages=(ChatTurn("system", line * 200), ChatTurn("user", question)))


def test_the_router_keeps_each_line_on_the_replica_that_has_its_prefix(monkeypatch):
    r1, r2 = _Replica("r1"), _Replica("r2")
    _, route = _router(monkeypatch, {"r1": 0, "r2": 0})
    first = route([r1, r2], _line("A", "q1"))[0][0]
    # A new prefix goes where the fewest prefixes are: line B to the other replica.
    second = route([r1, r2], _line("B", "q1"))[0][0]
    assert {first, second} == {r1, r2}
    for question in ("q2", "q3", "q4"):
        assert route([r1, r2], _line("A", question))[0] == [first], "line A stays where its prefix is"
        assert route([r1, r2], _line("B", question))[0] == [second]
    # Serve's ranking follows as the fallback (a full replica is skipped).
    assert route([r1, r2], _line("A", "q5"))[1] == [r1, r2]


def test_balance_wins_when_the_replica_with_the_prefix_is_much_busier(monkeypatch):
    r1, r2 = _Replica("r1"), _Replica("r2")
    lens = {"r1": 0, "r2": 0}
    _, route = _router(monkeypatch, lens, imbalanced=3)
    home = route([r1, r2], _line("A", "q1"))[0][0]
    lens[home.replica_id] = 4  # 4 more in flight than the other: past imbalanced_requests
    assert route([r1, r2], _line("A", "q2")) == [[r1, r2]], "Serve's own choice"
    lens[home.replica_id] = 3
    assert route([r1, r2], _line("A", "q3"))[0] == [home]


def test_calls_without_a_prefix_and_single_replicas_get_serves_choice(monkeypatch):
    r1, r2 = _Replica("r1"), _Replica("r2")
    _, route = _router(monkeypatch, {})
    assert route([r1, r2], EmbedCall(texts=("a",))) == [[r1, r2]]
    assert route([r1], _line("A", "q")) == [[r1]]


def test_new_prefixes_routed_at_the_same_moment_spread_over_the_replicas(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    r1, r2 = _Replica("r1"), _Replica("r2")
    router, _ = _router(monkeypatch, {"r1": 0, "r2": 0})

    async def burst():  # four lines at once: each routing task waits on its queue probe
        return await asyncio.gather(*(router.choose_replicas([r1, r2], SimpleNamespace(args=(_line(line, "q"),)))
                                      for line in "ABCD"))

    chosen = [groups[0][0] for groups in asyncio.run(burst())]
    assert sorted(chosen, key=repr) == [r1, r1, r2, r2], chosen
