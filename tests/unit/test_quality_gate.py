"""The quality gate of `python -m serve_app.optimize` and the compressed-tensors
checkpoints it writes for vLLM."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from serve_app.core.models import LoadOptions, load_runtime
from serve_app.core.models.checkpoint_formats import checkpoint_format
from serve_app.optimize import calibration_texts, checkpoints, evaluation, pruning, smoothing
from serve_app.optimize import __main__ as cli
from serve_app.optimize.evaluation import QualityFloor


def test_the_floor_names_each_figure_below_it():
    floor = QualityFloor()
    assert floor.shortfalls({"greedy_agreement": 0.95, "perplexity_reference": 10.0, "perplexity_candidate": 10.4}) == []
    short = floor.shortfalls({"greedy_agreement": 0.85, "perplexity_reference": 10.0, "perplexity_candidate": 11.0})
    assert short == ["greedy agreement 0.85 < 0.9", "perplexity 11.0 is 10.0% above 10.0 (at most 5%)"]
    assert floor.shortfalls({"embedding_cosine_mean": 0.98, "retrieval_accuracy_reference": 0.96,
                             "retrieval_accuracy_candidate": 0.92}) == [
        "embedding cosine 0.98 < 0.99", "retrieval accuracy 0.92 < 0.96 of the full-precision model"]


def test_the_evaluation_set_ships_with_the_package():
    items, pairs = evaluation.chat_items(), evaluation.retrieval_pairs()
    assert len(items) >= 20 and any(item.expect for item in items)
    assert len(pairs) >= 20 and len({p for _, p in pairs}) == len(pairs)


@pytest.mark.parametrize("fmt", ["w8a8", "w4a16"])
def test_a_written_checkpoint_is_the_format_vllm_reads_and_quality_is_measured_on_what_vllm_runs(
        tiny_llama_vllm_dir, tmp_path, fmt):
    original = load_runtime(LoadOptions(source=str(tiny_llama_vllm_dir), task="text-generation"))
    calibration = pruning.calibration_batches(original.tokenizer, calibration_texts()[:32], max_length=32)
    model = checkpoints.quantize_in_memory(copy.deepcopy(original.model), fmt, calibration)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.inference_mode():
        reference, quantized = original.model(input_ids=ids).logits, model(input_ids=ids).logits
    # The fake-quantized forward rounds (it is what the gate measures), but stays close,
    # even on a random model's wide weights (initializer_range 0.2).
    assert not torch.equal(reference, quantized)
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(), quantized.flatten(), dim=0)
    assert cosine > {"w8a8": 0.99, "w4a16": 0.8}[fmt], cosine
    checkpoints.save_checkpoint(model, original.model_path, tmp_path / fmt)
    assert checkpoint_format(tmp_path / fmt) == fmt
    config = json.loads((tmp_path / fmt / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"]
    assert (tmp_path / fmt / "tokenizer.json").is_file() and (tmp_path / fmt / "generation_config.json").is_file()
    assert sum(f.stat().st_size for f in (tmp_path / fmt).glob("*.safetensors")) < sum(
        f.stat().st_size for f in tiny_llama_vllm_dir.glob("*.safetensors"))


def test_smoothing_folds_scales_without_changing_what_the_model_computes(tiny_llama_vllm_dir):
    original = load_runtime(LoadOptions(source=str(tiny_llama_vllm_dir), task="text-generation"))
    model = copy.deepcopy(original.model)
    calibration = pruning.calibration_batches(original.tokenizer, calibration_texts()[:32], max_length=32)
    assert smoothing.smooth(model, calibration) == 2 * 2  # two layers, two norms each
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.inference_mode():
        assert torch.allclose(original.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4)
    layer, before = model.model.layers[0], original.model.model.layers[0]
    assert not torch.allclose(layer.input_layernorm.weight, before.input_layernorm.weight)


def test_quantize_format_refuses_a_variant_below_the_floor_and_writes_nothing(tiny_llama_vllm_dir, tmp_path,
                                                                              monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["quantize", "--source", str(tiny_llama_vllm_dir), "--task", "text-generation", "--format", "w8a8",
            "--out", str(tmp_path / "w8a8")]
    assert cli.main([*args, "--min-greedy-agreement", "1.01"]) == cli.BELOW_FLOOR
    assert "below the quality floor: greedy agreement" in capsys.readouterr().out
    assert not (tmp_path / "w8a8").exists()
    refused = json.loads((tmp_path / "optimize-reports" / f"quantize-{tiny_llama_vllm_dir.name}-refused.json").read_text())
    assert refused["gate"] == {**refused["gate"], "passed": False, "written": False}
    assert cli.main([*args, "--min-greedy-agreement", "0", "--max-perplexity-increase", "100"]) == 0
    assert checkpoint_format(tmp_path / "w8a8") == "w8a8"


def test_precision_auto_stays_fp32_where_bf16_falls_below_the_floor_and_measures_once(tiny_llama_dir, tmp_path,
                                                                                      monkeypatch):
    from serve_app.optimize import precision_gate

    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path))
    measured = []

    def fake_measure(model_dir, task, device, trust_remote_code=False):
        measured.append(model_dir)
        return {"greedy_agreement": 0.7, "perplexity_reference": 10.0, "perplexity_candidate": 10.1}

    monkeypatch.setattr(precision_gate, "measure", fake_measure)
    for _ in range(2):
        precision, why = precision_gate.gated_precision(tiny_llama_dir, "text-generation", "cpu", "cpu")
        assert precision == "fp32"
        assert why.startswith("bf16 falls below the quality floor (greedy agreement 0.7 < 0.9")
    assert len(measured) == 1 and "measured before" in why  # the verdict is kept

    # Another model (other files) is measured on its own; one that keeps the floor gets bf16.
    monkeypatch.setattr(precision_gate, "measure", lambda *a, **k: {"embedding_cosine_mean": 0.9999})
    precision, why = precision_gate.gated_precision(tiny_llama_dir, "embedding", "cpu", "cpu")
    assert precision == "bf16" and "keeps the quality floor" in why


def test_the_gate_measures_bf16_against_fp32_with_the_optimize_figures(tiny_bert_embedding_dir):
    from serve_app.optimize import precision_gate

    figures = precision_gate.measure(tiny_bert_embedding_dir, "embedding", "cpu")
    assert 0.9 < figures["embedding_cosine_mean"] <= 1.0
    assert 0 <= figures["retrieval_accuracy_candidate"] <= 1


def test_a_model_the_gate_cannot_measure_keeps_the_hardwares_pick(tiny_llama_dir, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from serve_app.optimize import precision_gate

    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path))
    monkeypatch.setattr(precision_gate, "resolve_precision", lambda precision, device: ("bf16", "auto: bf16 units"))

    def unloadable(*args, **kwargs):
        raise ValueError("architecture FooForCausalLM is not supported")

    monkeypatch.setattr(precision_gate, "measure", unloadable)
    config = SimpleNamespace(name="m", precision="auto", quantization="none", task="text-generation",
                             source=str(tiny_llama_dir), hub_revision=None, trust_remote_code=False)
    precision, why = precision_gate.replica_precision(config, SimpleNamespace(type="cpu"))
    assert precision == "bf16" and why == "auto: bf16 units; not gated: ValueError"


def test_the_chat_evaluation_in_batches_gives_the_figures_of_one_prompt_at_a_time(tiny_llama_dir):
    options = dict(source=str(tiny_llama_dir), task="text-generation", device="cpu")
    reference = load_runtime(LoadOptions(**options, precision="fp32"))
    candidate = load_runtime(LoadOptions(**options, precision="bf16"))
    items = evaluation.chat_items()[:12]
    alone = evaluation.chat_agreement(reference, candidate, items, new_tokens=8, batch_prompts=1)
    batched = evaluation.chat_agreement(reference, candidate, items, new_tokens=8, batch_prompts=5)
    assert batched == alone
    # Against itself every teacher-forced choice agrees: the answer positions line up in the padded rows.
    same = evaluation.chat_agreement(reference, reference, items, new_tokens=8)
    assert same["greedy_agreement"] == 1.0 and same["answers_identical"] == 1.0
