"""deployments/local.yaml, as shipped, serving the package-carried models (offline)."""

import numpy as np
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture()
def local_api(deployed):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{deployed}/local/v1", api_key="unused", timeout=120)


def test_minilm_embeddings_rank_by_meaning(local_api):
    texts = ["A cat sits on the mat.", "A kitten is resting on a rug.", "Quarterly revenue grew by 4%."]
    vectors = np.array([d.embedding for d in local_api.embeddings.create(model="minilm", input=texts).data])
    assert vectors.shape == (3, 384)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2


def test_smollm2_chat_answers(local_api):
    chat = local_api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=8,
        temperature=0,
    )
    assert "paris" in chat.choices[0].message.content.lower()
    assert chat.usage.completion_tokens <= 8
