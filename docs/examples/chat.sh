# A chat completion from SmolLM2 (deployments/local.yaml), pretty-printed.
URL=${SERVE_APP_URL:-http://127.0.0.1:8000}
curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "smollm2",
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "max_tokens": 8, "temperature": 0
  }' | python3 -m json.tool
