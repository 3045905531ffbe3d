# Two MiniLM embeddings; the one-liner prints their count, size and token usage.
URL=${SERVE_APP_URL:-http://127.0.0.1:8000}
curl -s "$URL/v1/embeddings" -H 'Content-Type: application/json' \
  -d '{"model": "minilm", "input": ["The cat sat on the mat.", "A dog barked."]}' |
  python3 -c 'import json, sys; r = json.load(sys.stdin); print(len(r["data"]), "vectors of", len(r["data"][0]["embedding"]), "numbers, usage", r["usage"])'
