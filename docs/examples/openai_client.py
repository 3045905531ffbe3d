"""The official openai client, unchanged, against serve_app (run with .venv/bin/python)."""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("SERVE_APP_URL", "http://127.0.0.1:8000") + "/v1", api_key="unused")

reply = client.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    max_tokens=8,
    temperature=0,
)
print(reply.choices[0].message.content)

vectors = client.embeddings.create(model="minilm", input=["hello", "world"])
print(len(vectors.data), len(vectors.data[0].embedding))

stream = client.chat.completions.create(  # the same answer, token by token as it is generated
    model="smollm2",
    messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    max_tokens=8,
    temperature=0,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
