"""Shared fixtures: a tiny randomly initialised causal LM with a character-level tokenizer."""

from __future__ import annotations

import importlib.util
import os
import shutil
import string
import sys
from pathlib import Path

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# `make test` runs the suite on one pytest-xdist worker per core. Each worker, and every polo process a test starts,
# gets an equal share of the cores: left alone, every worker's torch would start a thread per core, and on a
# 2-core machine four threads waiting on one another run the suite slower than one worker does.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _SHARE = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    os.environ["OMP_NUM_THREADS"] = _SHARE
    torch.set_num_threads(int(_SHARE))


# GSM8K is never downloaded by the tests: they read it from $POLO_GSM8K_DIR, or from a `shared/data/gsm8k` folder
# beside the checkout when there is one, and skip (saying so) without it.
_GSM8K_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
if "POLO_GSM8K_DIR" not in os.environ and (_GSM8K_BESIDE / "test.jsonl").is_file():
    os.environ["POLO_GSM8K_DIR"] = str(_GSM8K_BESIDE)


@pytest.fixture(autouse=True)
def _forget_modules_written_by_the_test(tmp_path_factory):
    """Tests write user modules (`my_rewards.py`, ...) into their own tmp dirs and import them by name; a later
    test writing a module of the same name must import its own file, not the one `sys.modules` kept."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]


def pytest_collection_modifyitems(config, items) -> None:
    """Skip the `cuda`-marked tests, with the reason shown, where torch sees no CUDA GPU.

    A skip is reported as one (`-rs`, or the `-ra` of the project's pytest options), never as a pass.
    """
    if torch.cuda.is_available():
        return
    reason = f"needs a CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def char_tokenizer(padding_side: str = "right"):
    """Return a character-level tokenizer: every printable character one id, chat template, EOS and padding
    <|im_end|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(specials + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = padding_side
    return tokenizer


def build_tiny_model(directory: Path, seed: int = 0, **sizes) -> Path:
    """Save a 2-layer Llama with a character tokenizer (chat template, EOS <|im_end|>) to `directory`; `sizes`
    override its LlamaConfig (hidden_size=64, say)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    vocab = tokenizer.get_vocab()
    torch.manual_seed(seed)
    config = {
        "vocab_size": len(vocab),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": vocab["<|im_end|>"],
        "pad_token_id": vocab["<|im_end|>"],
        "tie_word_embeddings": True,
    }
    model = LlamaForCausalLM(LlamaConfig(**{**config, **sizes}))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# The sizes of the in-memory tiny models: 2 layers, hidden 32, MLP 64, 4 heads over 2 kv heads, vocabulary 97.
TINY_SIZES = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny_llama(seed: int = 0, **config):
    """Return a random Llama of `TINY_SIZES` (tied embeddings) built in memory; `config` overrides any LlamaConfig
    field."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    defaults = {**TINY_SIZES, "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True}
    return LlamaForCausalLM(LlamaConfig(**{**defaults, **config}))


def tiny_qwen2(seed: int = 0, **config):
    """Return a random Qwen2 of `TINY_SIZES` (biases on q/k/v, an untied head) built in memory; `config` overrides
    any Qwen2Config field."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY_SIZES, "tie_word_embeddings": False, **config}))


def tiny_rl_config(model_dir, output_dir, **sections) -> dict:
    """Return a `polo train` config: a few GRPO steps on one-digit sums for the tiny model; `sections` update its
    sections."""
    config = {
        "model": {"name": str(model_dir)},
        "task": {"name": "arithmetic", "min_digits": 1, "max_digits": 1, "num_train": 40, "num_eval": 6},
        "rewards": {"correct": 1.0, "tag_count": 0.5},
        "sampling": {"max_new_tokens": 8, "temperature": 1.0},
        "algorithm": {"group_size": 4},
        "train": {
            "steps": 4,
            "prompts_per_step": 2,
            "micro_batch_size": 3,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "seed": 3,
        },
        "eval": {"batch_size": 4, "max_new_tokens": 6},
        "output": {
            "dir": str(output_dir),
            "save_every": 2,
            "progress": False,
            "report_to": ["tensorboard"],
            "plots": True,
        },
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


@pytest.fixture
def native_kernels():
    """polo's native CPU kernels (`torch.ops.polo_native`).

    A test that takes them fails where a C++ compiler exists and they did not build, and is skipped
    (with the reason shown) only where there is no compiler, the CPU has no AVX2, or `POLO_NATIVE=0`
    turns them off.
    """
    from polo.kernels.cpu.native import CAPABILITY_FLAGS, capability, native_ops, wanted

    if not wanted():
        pytest.skip("POLO_NATIVE=0: polo's native CPU kernels are off")
    if capability() not in CAPABILITY_FLAGS:
        pytest.skip(f"torch runs this CPU's kernels at {capability()}, without AVX2: polo builds no native kernels")
    ops = native_ops()
    if ops is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is here, but polo's native CPU kernels did not build (stderr says why)")
        pytest.skip("no C++ compiler here: polo's native CPU kernels cannot be built")
    return ops


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def load_benchmark():
    """Return `load(name)`, which loads benchmarks/<name>.py as a module; benchmarks/ (where the scripts import
    bench_common from) is on sys.path while the test module runs."""
    sys.path.insert(0, str(BENCHMARKS))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    try:
        yield load
    finally:
        sys.path.remove(str(BENCHMARKS))
