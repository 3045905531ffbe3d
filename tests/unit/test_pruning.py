"""serve_app.optimize.pruning and `python -m serve_app.optimize`: pruned models shrink, save,
reload through load_runtime with the right shapes, and distillation wins quality back."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import tiny_models
from serve_app.optimize import pruning
from serve_app.core.models.quantization import parameter_count
from serve_app.core.calls import SamplingParams
from serve_app.core.models import GenerationRequest, LoadOptions, load_runtime
from serve_app.optimize import __main__ as cli
from serve_app.optimize import calibration_texts, heldout_texts
from serve_app.optimize import quality


@pytest.fixture(scope="module")
def calibration() -> list[str]:
    return calibration_texts()


def _batches(runtime, texts, max_length=32):
    return pruning.calibration_batches(runtime.tokenizer, texts, batch_size=16, max_length=max_length)


def test_builtin_texts_are_varied_and_disjoint(calibration):
    heldout = heldout_texts()
    assert len(calibration) >= 250 and len(heldout) >= 100
    assert not set(calibration) & set(heldout)
    # A user's calibration file that repeats held-out lines loses them from the held-out set.
    assert heldout_texts(exclude=heldout[:3]) == heldout[3:]


def test_bert_ffn_pruning_saves_a_smaller_model_that_loads(tiny_bert_embedding_dir, calibration, tmp_path):
    original = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))
    student = copy.deepcopy(original.model)
    summary = pruning.prune_model(student, _batches(original, calibration[:64]), ffn_keep=0.5)
    assert summary.family == "bert" and summary.intermediate_size == (64, 32)
    assert parameter_count(student) < parameter_count(original.model)
    out = pruning.save_model_dir(student, original.model_path, tmp_path / "pruned")
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 32
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()

    reloaded = load_runtime(LoadOptions(source=str(out), task="embedding"))
    assert reloaded.model.encoder.layer[0].intermediate.dense.out_features == 32
    assert parameter_count(reloaded.model) == parameter_count(student)
    vectors = reloaded.embed([reloaded.tokenize("a short sentence"), reloaded.tokenize("another one, longer")])
    assert len(vectors) == 2 and all(len(v) == original.dimensions for v in vectors)
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-4
    # The saved weights are the pruned model's, not a re-initialisation.
    expected = torch.tensor(quality.with_model(original, student).embed([original.tokenize("a short sentence")]))
    assert torch.allclose(torch.tensor(vectors[:1]), expected, atol=1e-5)


def test_bert_classifier_prunes_and_classifies(tiny_bert_classifier_dir, calibration, tmp_path):
    original = load_runtime(LoadOptions(source=str(tiny_bert_classifier_dir), task="text-classification"))
    student = copy.deepcopy(original.model)
    pruning.prune_model(student, _batches(original, calibration[:32]), ffn_keep=0.5)
    out = pruning.save_model_dir(student, original.model_path, tmp_path / "pruned")
    reloaded = load_runtime(LoadOptions(source=str(out), task="text-classification"))
    ranked = reloaded.classify([reloaded.tokenize("great film")], top_k=2)
    assert [label for label, _ in ranked[0]] in (["negative", "positive"], ["positive", "negative"])


def test_bert_heads_cannot_be_pruned_and_the_error_says_why(tiny_bert_embedding_dir, calibration):
    original = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))
    student = copy.deepcopy(original.model)
    with pytest.raises(ValueError) as info:
        pruning.prune_model(student, _batches(original, calibration[:16]), ffn_keep=0.5, heads_keep=0.5)
    assert "transformers 5 removed prune_heads" in str(info.value) and "--heads-keep 1" in str(info.value)
    assert student.config.intermediate_size == 64  # nothing was pruned before the refusal


def test_llama_ffn_and_kv_group_pruning_reloads_and_generates(tiny_llama_dir, calibration, tmp_path):
    original = load_runtime(LoadOptions(source=str(tiny_llama_dir), task="text-generation"))
    student = copy.deepcopy(original.model)
    summary = pruning.prune_model(student, _batches(original, calibration[:32]), ffn_keep=0.5, heads_keep=0.5)
    assert summary.family == "llama" and summary.intermediate_size == (64, 32) and summary.attention_heads == (4, 2)
    out = pruning.save_model_dir(student, original.model_path, tmp_path / "pruned")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 8)

    reloaded = load_runtime(LoadOptions(source=str(out), task="text-generation"))
    attention = reloaded.model.model.layers[0].self_attn
    assert attention.q_proj.out_features == 16 and attention.k_proj.out_features == 8
    assert parameter_count(reloaded.model) < parameter_count(original.model)
    ids = reloaded.encode_prompt("Hello world")
    with torch.inference_mode():
        logits = reloaded.model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), original.model.config.vocab_size)
    result = reloaded.generate([GenerationRequest(prompt_ids=ids, max_tokens=4)], SamplingParams(temperature=0.0))
    assert result[0].completion_tokens == 4


def test_importance_prefers_neurons_that_contribute(tiny_llama_dir, calibration):
    runtime = load_runtime(LoadOptions(source=str(tiny_llama_dir), task="text-generation"))
    model = copy.deepcopy(runtime.model)
    silenced = [0, 5, 17, 40]
    with torch.no_grad():
        for layer in model.model.layers:  # these neurons can no longer reach the residual stream
            layer.mlp.down_proj.weight[:, silenced] = 0
    importance = pruning.importance_scores(model, _batches(runtime, calibration[:32]))
    for scores in importance.ffn:
        assert scores.shape == (64,) and all(scores[j] == 0 for j in silenced)
        assert (scores > 0).sum() == 64 - len(silenced)
    pruning.prune_ffn(model, importance, keep=0.5)
    kept_rows = model.model.layers[0].mlp.down_proj.weight
    assert kept_rows.shape == (32, 32) and bool((kept_rows.abs().sum(dim=0) > 0).all())


def test_keeping_everything_changes_nothing(tiny_bert_embedding_dir, calibration):
    runtime = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))
    model = copy.deepcopy(runtime.model)
    pruning.prune_model(model, _batches(runtime, calibration[:16]), ffn_keep=1.0, heads_keep=1.0)
    for before, after in zip(runtime.model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(before, after)


def test_recovery_raises_embedding_quality(minilm_package_available, calibration):
    """Measured: 50% FFN of MiniLM gives cosine ~0.88 on 40 held-out texts, 30 steps ~0.91."""
    if not minilm_package_available:
        pytest.skip(f"{tiny_models.MINILM_PACKAGE} is not installed")
    original = load_runtime(LoadOptions(source=f"package:{tiny_models.MINILM_PACKAGE}", task="embedding"))
    texts = heldout_texts(exclude=calibration)[:40]
    batches = _batches(original, calibration)
    student = copy.deepcopy(original.model)
    pruning.prune_model(student, batches, ffn_keep=0.5)
    before = quality.embedding_agreement(original, quality.with_model(original, student), texts)
    result = pruning.recover(student, original.model, batches, steps=30, learning_rate=3e-4, progress=False)
    after = quality.embedding_agreement(original, quality.with_model(original, student), texts)
    assert result.last_loss < result.first_loss
    assert after["embedding_cosine_mean"] >= before["embedding_cosine_mean"] + 0.015, (before, after)
    assert not any(p.requires_grad for p in student.parameters()) and not student.training


def test_cli_prune_and_quantize_write_reports(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "pruned"
    common = ["--task", "text-generation", "--repeats", "2", "--decode-tokens", "2", "--batch-rows", "4",
              "--batch-tokens", "16"]
    assert cli.main(["prune", "--source", str(tiny_llama_dir), *common, "--ffn-keep", "0.5", "--out", str(out),
                     "--recover-steps", "3", "--calibration-max-tokens", "32", "--allow-below-floor"]) == 0
    report = json.loads((out / "optimize-report.json").read_text())
    names = [row["name"] for row in report["models"]]
    assert names == ["original", "pruned ffn 0.5 heads 1, no recovery", "pruned ffn 0.5 heads 1 + 3 recovery steps"]
    pruned_row = report["models"][-1]
    assert pruned_row["parameters"] < report["models"][0]["parameters"]
    assert 0 <= pruned_row["quality"]["next_token_agreement"] <= 1 and pruned_row["speed"]["latency_ms_median"] > 0
    assert report["heldout"]["disjoint_from_calibration"] and report["recovery"]["steps"] == 3
    assert report["gate"]["written"] and 0 <= pruned_row["quality"]["greedy_agreement"] <= 1
    assert "| original |" in (out / "optimize-report.md").read_text()
    assert load_runtime(LoadOptions(source=str(out), task="text-generation")).model.config.intermediate_size == 32

    report_path = tmp_path / "q" / "int8.json"
    assert cli.main(["quantize", "--source", str(tiny_llama_dir), *common, "--mode", "int8",
                     "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert [row["quantization"] for row in report["models"]] == ["none", "int8"]
    assert report["models"][1]["weight_bytes_in_memory"] < report["models"][0]["weight_bytes_in_memory"]
    assert report_path.with_suffix(".md").is_file()

    assert cli.main(["quantize", "--source", str(tiny_llama_dir), *common, "--mode", "bnb-4bit",
                     "--report", str(tmp_path / "bnb.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
