"""Weight quantization of loaded models: which modes exist, where each one runs, and
how to apply it.

Modes (``quantization:`` of a model in the config, :attr:`LoadOptions.quantization`):

- ``none``: weights in the model's ``precision`` (fp32, bf16, fp16).
- ``int8``: torchao int8 weight-only, one scale per output row. Activations stay in
  ``precision``; CPU and GPU, any precision the device allows.
- ``int4``: torchao int4 weight-only, asymmetric, one scale and zero point per
  :data:`INT4_GROUP_SIZE` input weights. Its kernels (``_weight_int4pack_mm*``, the
  "tinygemm" kernels) take bf16 activations; on CPU fp32 activations fall back to a
  path about 90x slower, so int4 needs ``precision: bf16`` on both device types.
- ``bnb-8bit`` / ``bnb-4bit``: bitsandbytes LLM.int8() and NF4 through transformers'
  ``BitsAndBytesConfig``, applied while loading. CUDA only, computing in bf16 or fp16.

torchao modes quantize ``nn.Linear`` layers after the model is loaded and moved to its
device (:func:`quantize_weights`); bitsandbytes modes go in as ``from_pretrained``
arguments (:func:`from_pretrained_kwargs`). Embedding tables stay in ``precision``,
and so does an output layer that shares its weight with the input embeddings
(quantizing it would store a second copy next to the embedding table it is tied to).

This module imports torch only inside functions, so that :mod:`serve_app.config`
can check a config with :func:`check_quantization` without importing torch. It must
never import ray.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # torch stays out of import time (see the module docstring)
    import torch

logger = logging.getLogger(__name__)

Quantization = Literal["none", "int8", "int4", "bnb-8bit", "bnb-4bit"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)

TORCHAO_MODES = ("int8", "int4")
BNB_MODES = ("bnb-8bit", "bnb-4bit")

#: Input weights that share one int4 scale and zero point. 32 is the finest group the
#: kernels take: on all-MiniLM-L6-v2 it keeps embedding cosine at about 0.96, where
#: 128 drops to about 0.91. Layers whose input width is not a multiple stay unquantized.
INT4_GROUP_SIZE = 32


class _TorchaoImportNoise(logging.Filter):
    """Drops the warnings that importing torchao 0.18 logs on a CPU-only torch.

    transformers imports torchao whenever it is installed (for its TorchAo quantizer),
    so every model load in every process would log them: one "Failed to load" per CUDA
    kernel library (``_C_mxfp8``, ``_C_cutlass_90a``), which cannot load without CUDA
    and are not used on CPU, that Triton (a GPU compiler) is missing, and torch's
    deprecation notice for the Enum types torchao registers with pytree. Any other
    record, and the CUDA-related ones on a CUDA build, pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torch.utils._pytree":
            return "is an Enum subclass and is now natively supported" not in message
        if (message.startswith("Failed to load") and "/torchao/_C" in message) or "Detected no triton" in message:
            import torch  # already imported: torchao is importing it

            return torch.version.cuda is not None
        return True


# Logger filters see only records logged on that very logger, hence each by name.
for _logger_name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
    logging.getLogger(_logger_name).addFilter(_TorchaoImportNoise())


def device_type_of(device: Any) -> str:
    """'cpu' or 'cuda' from a torch.device or a device string such as 'cuda:1'."""
    return str(getattr(device, "type", device)).split(":")[0].strip().lower()


def check_quantization(quantization: str, precision: str, device_type: str) -> None:
    """Raise ValueError, saying what would work instead, if this combination cannot run.

    ``device_type`` is 'cpu' or 'cuda' (a full device string is accepted too).
    """
    device_type = device_type_of(device_type)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if precision == "fp16" and device_type == "cpu":
        raise ValueError("precision fp16 needs a GPU; use precision: bf16 or fp32 on CPU")
    if quantization in BNB_MODES:
        if device_type != "cuda":
            raise ValueError(
                f"quantization {quantization} needs a CUDA GPU (bitsandbytes kernels); on CPU use "
                "quantization: int8 (any precision) or quantization: int4 with precision: bf16"
            )
        if precision == "fp32":
            raise ValueError(
                f"quantization {quantization} computes in 16 bits; set precision: bf16 (or fp16) "
                "instead of fp32"
            )
    if quantization == "int4" and precision != "bf16":
        slow = " (on CPU with fp32 activations it runs about 90x slower)" if device_type == "cpu" else ""
        raise ValueError(
            f"quantization int4 needs precision bf16, got {precision}: its int4 kernels take bf16 "
            f"activations{slow}; set precision: bf16, or use quantization: int8 with precision: {precision}"
        )


def from_pretrained_kwargs(quantization: str, device: Any, dtype: "torch.dtype | None" = None) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments for modes applied while loading (bitsandbytes).

    Empty for ``none`` and the torchao modes, which :func:`quantize_weights` applies
    after the load. For bitsandbytes: a ``BitsAndBytesConfig`` (NF4 with ``dtype`` as
    compute dtype for 4 bit) and a ``device_map`` that places the whole model on
    ``device``, since bitsandbytes quantizes while the weights move to the GPU and the
    model cannot be moved afterwards.
    """
    if quantization not in BNB_MODES:
        return {}
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"quantization {quantization} needs the bitsandbytes package; install it "
            "(`pip install bitsandbytes`) or use quantization: int8 or int4 (torchao)"
        )
    import torch
    from transformers import BitsAndBytesConfig

    if quantization == "bnb-8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype or torch.bfloat16,
        )
    placement = torch.device(device)
    if placement.index is None:  # "cuda": the current device, as .to("cuda") would pick
        placement = torch.device("cuda", torch.cuda.current_device())
    return {"quantization_config": config, "device_map": {"": str(placement)}}


def _torchao():
    """torchao's quantize_ entry point, or a ValueError that says how to get it."""
    try:
        import torchao.quantization as ao
    except ImportError as exc:
        raise ValueError(
            f"quantization int8/int4 needs the torchao package ({exc}); install it "
            "(`pip install torchao`) or set quantization: none"
        ) from exc
    return ao


def _embedding_weights(model: Any) -> set[int]:
    """ids of every embedding table's weight: a Linear holding one is a tied output layer."""
    import torch

    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def quantize_weights(model: Any, quantization: str) -> Any:
    """Quantize the model's ``nn.Linear`` weights in place with torchao; returns the model.

    Does nothing for ``none`` and for the bitsandbytes modes (already quantized while
    loading). The model must already be on its device and in its precision: int4 packs
    weights differently for CPU and CUDA kernels.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization not in TORCHAO_MODES:
        return model
    import torch

    from serve_app.core.models.devices import DTYPES

    first = next(model.parameters())
    device_type, dtype = first.device.type, first.dtype
    precision = {d: name for name, d in DTYPES.items()}.get(dtype, str(dtype))
    check_quantization(quantization, precision, device_type)
    ao = _torchao()
    # HQQ picks int4 scales and zero points by a short optimization instead of min/max:
    # on all-MiniLM-L6-v2 embedding cosine 0.979 against 0.975, for ~3 s more at load
    # for a 135M-parameter model.
    if quantization == "int8":
        config, group = ao.Int8WeightOnlyConfig(), 1  # per-row scales fit any width
    elif device_type == "cpu":
        # The stable Int4WeightOnlyConfig has CUDA layouts only; the CPU one (packed for
        # _weight_int4pack_mm_for_cpu) is a prototype in torchao 0.18.
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_choose_qparams_algorithm="hqq")
        group = INT4_GROUP_SIZE
    else:
        config = ao.Int4WeightOnlyConfig(
            group_size=INT4_GROUP_SIZE, int4_packing_format="tile_packed_to_4d", int4_choose_qparams_algorithm="hqq",
        )
        group = INT4_GROUP_SIZE

    tied = _embedding_weights(model)
    skipped: list[str] = []

    def wanted(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        if id(module.weight) in tied or module.in_features % group:
            skipped.append(name)
            return False
        return True

    ao.quantize_(model, config, filter_fn=wanted)
    if skipped:
        logger.info("%s left %d linear layer(s) unquantized (tied to the embeddings or width not a multiple of %d): %s",
                    quantization, len(skipped), INT4_GROUP_SIZE, ", ".join(skipped[:8]))
    return model


def _storage_tensors(tensor: "torch.Tensor"):
    """The plain tensors that hold a (possibly tensor-subclass) tensor's data."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _storage_tensors(getattr(tensor, name))
    else:
        yield tensor


def weight_bytes(model: Any) -> int:
    """Bytes that the model's parameters and buffers take in memory.

    Quantized tensors count their stored parts (packed integers, scales, zero points),
    not their logical shape; bitsandbytes 4-bit parameters add their quantization
    state; a tensor shared by several modules (tied embeddings) counts once.
    """
    seen: set[tuple[int, int, str]] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        for part in _storage_tensors(tensor):
            if part.device.type == "meta":
                continue
            key = (part.data_ptr(), part.numel(), str(part.dtype))
            if key in seen:
                continue
            seen.add(key)
            total += part.numel() * part.element_size()

    for param in model.parameters():
        add(param)
        quant_state = getattr(param, "quant_state", None)  # bitsandbytes Params4bit
        for extra in (getattr(quant_state, "absmax", None), getattr(quant_state, "code", None)):
            if extra is not None:
                add(extra)
    for buffer in model.buffers():
        add(buffer)
    return total


def parameter_count(model: Any) -> int:
    """Weights the model holds (logical elements; a tied tensor counts once)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
    return total
