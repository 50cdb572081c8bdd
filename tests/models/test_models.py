"""Model loading: clear errors for paths that are not causal LMs; the reference copy is frozen."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from polo.models.loading import ModelLoadError, frozen_copy, load_policy, resolve_model_path


def test_missing_path_names_it_and_the_builtins(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct") as error:
        resolve_model_path(str(tmp_path / "missing"))
    assert "missing" in str(error.value)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_non_causal_architecture_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertForSequenceClassification"], "model_type": "bert"})
    )
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        resolve_model_path(str(tmp_path))


def test_load_policy_sets_left_padding_and_pad_token(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None
    assert model.dtype == torch.float32


def test_reference_copy_is_frozen_and_independent(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    reference = frozen_copy(model)
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(next(model.parameters()), next(reference.parameters()))


def test_bf16_copy_keeps_float32_buffers_and_can_be_resynced(tiny_model_dir):
    from polo.models.loading import copy_weights, frozen_copy

    model, _ = load_policy(str(tiny_model_dir))
    sampler = frozen_copy(model, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in sampler.parameters())
    assert all(b.dtype == torch.float32 for b in sampler.buffers() if b.is_floating_point())  # e.g. rotary frequencies
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)
    copy_weights(sampler, model)
    for mine, theirs in zip(sampler.parameters(), model.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16))


def _copy_of(model_dir, target):
    import shutil

    shutil.copytree(model_dir, target)
    return target


def test_garbage_safetensors_names_the_file(tiny_model_dir, tmp_path):
    model_dir = _copy_of(tiny_model_dir, tmp_path / "garbage")
    (model_dir / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(
        ModelLoadError, match=r"model weights .*garbage/model\.safetensors cannot be read \(.*header"
    ) as error:
        load_policy(str(model_dir))
    assert "\n" not in str(error.value)


def test_truncated_safetensors_names_the_file(tiny_model_dir, tmp_path):
    model_dir = _copy_of(tiny_model_dir, tmp_path / "cut")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut/model\.safetensors cannot be read .*damaged or incomplete"):
        resolve_model_path(str(model_dir))


def test_unreadable_config_json_names_the_file(tiny_model_dir, tmp_path):
    model_dir = _copy_of(tiny_model_dir, tmp_path / "badconfig")
    (model_dir / "config.json").write_text("{architectures: [")
    with pytest.raises(ModelLoadError, match=r"badconfig/config\.json is not a readable JSON file"):
        resolve_model_path(str(model_dir))


def test_damaged_tokenizer_names_the_directory(tiny_model_dir, tmp_path):
    model_dir = _copy_of(tiny_model_dir, tmp_path / "badtokenizer")
    (model_dir / "tokenizer.json").write_text("not json")
    with pytest.raises(ModelLoadError, match=r"could not load the tokenizer of .*badtokenizer"):
        load_policy(str(model_dir))


def test_the_cache_keyword_follows_the_model_forward_signature(tiny_model_dir):
    """transformers 5.24 takes `cache=`; an older forward that knows only `past_key_values=` gets that name."""
    from polo.models.family import cache_keyword

    model, _ = load_policy(str(tiny_model_dir))
    expected = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert cache_keyword(model) == expected

    class OlderForward(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(OlderForward()) == "past_key_values"
