"""`train.gradient_checkpointing: auto`: activations are recomputed only for micro-batches too large to keep them."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_rl_config
from polo.config import ConfigError, load_config
from polo.models.loading import (
    ACTIVATION_BYTES_PER_UNIT,
    AUTO_RECOMPUTE_SHARE,
    load_policy,
    recompute_above,
    recompute_scope,
    recompute_threshold,
    setup_activation_checkpointing,
)
from polo.runtime.device import host_available_memory


def test_threshold_is_the_token_count_whose_activations_fill_the_share_of_memory():
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30, hidden_size=576))
    available = 20 * 2**30
    threshold = recompute_threshold(model, available)
    per_token = 30 * 576 * ACTIVATION_BYTES_PER_UNIT
    assert threshold * per_token <= AUTO_RECOMPUTE_SHARE * available < (threshold + 1) * per_token
    assert recompute_threshold(model, 2 * available) in (2 * threshold, 2 * threshold + 1)
    assert recompute_threshold(model, None) == 0  # memory unknown: always recompute
    nested = SimpleNamespace(config=SimpleNamespace(text_config=model.config))  # a multimodal model's text tower
    assert recompute_threshold(nested, available) == threshold


def layer_forward_counter(model) -> list[int]:
    """Count forwards of the decoder's first layer's MLP (a recomputation in backward runs it again; a pre-hook, as
    the recomputation stops once it has what backward needs, before the MLP returns)."""
    count = [0]
    model.get_decoder().layers[0].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def forward_backward(model, tokens: int) -> None:
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    with recompute_scope(model, tokens):
        loss = model(input_ids=ids).logits.float().mean()
    loss.backward()


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_auto_recomputes_only_above_the_threshold(tiny_model_dir, setting):
    model, _ = load_policy(str(tiny_model_dir))
    model.train()
    setup_activation_checkpointing(model, setting, available_bytes=1)  # auto: threshold 0 tokens
    if setting == "auto":
        model.polo_recompute_above = 6  # then: 6 tokens kept, 7 recomputed
    count = layer_forward_counter(model)
    runs = {}
    for tokens in (6, 7):
        count[0] = 0
        forward_backward(model, tokens)
        runs[tokens] = count[0]
    expected = {"auto": {6: 1, 7: 2}, True: {6: 2, 7: 2}, False: {6: 1, 7: 1}}[setting]
    assert runs == expected
    flags = {m.gradient_checkpointing for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")}
    assert flags == ({True} if setting in ("auto", True) else set())  # the scope restores the layers' setting
    assert recompute_above(model) == (6 if setting == "auto" else None)


def test_gradients_are_the_same_recomputed_or_kept(tiny_model_dir):
    grads = []
    for above in (100, 0):
        model, _ = load_policy(str(tiny_model_dir))
        model.train()
        setup_activation_checkpointing(model, "auto", available_bytes=None)
        model.polo_recompute_above = above
        torch.manual_seed(0)
        forward_backward(model, 9)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    kept, recomputed = grads
    assert kept.keys() == recomputed.keys() and kept
    for name, grad in kept.items():
        torch.testing.assert_close(recomputed[name], grad, msg=name)


def test_setting_takes_true_false_auto_and_names_the_choices_otherwise():
    assert load_config({}).train.gradient_checkpointing == "auto"
    assert load_config({"train": {"gradient_checkpointing": True}}).train.gradient_checkpointing is True
    assert load_config({"train": {"gradient_checkpointing": False}}).train.gradient_checkpointing is False
    with pytest.raises(ConfigError, match="train.gradient_checkpointing: 'sometimes' is not one of true, false, auto"):
        load_config({"train": {"gradient_checkpointing": "sometimes"}})


def test_host_memory_is_read_on_linux():
    available = host_available_memory()
    assert available is None or available > 0
    meminfo = Path("/proc/meminfo")
    if meminfo.exists() and "MemAvailable" in meminfo.read_text():
        assert available is not None and available > 2**20


class Part:
    """The two masks of a micro-batch of rollouts (4 rows: two groups of two)."""

    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 0]])

    def __len__(self) -> int:
        return 4


def test_the_update_counts_a_shared_prompt_once_where_attention_reads_the_shared_layout():
    from polo.kernels.cpu.attention import POLO_ATTENTION
    from polo.rl.update import trunk_tokens

    blockwise = SimpleNamespace(config=SimpleNamespace(_attn_implementation=POLO_ATTENTION))
    dense = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    assert trunk_tokens(blockwise, Part(), group_size=2) == (2 + 3) + 4
    assert trunk_tokens(dense, Part(), group_size=2) == (2 + 2 + 3 + 3) + 4
    assert trunk_tokens(blockwise, Part(), group_size=1) == (2 + 2 + 3 + 3) + 4


def test_a_run_with_auto_recomputes_above_its_threshold_and_learns_the_same(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """`polo train` with gradient_checkpointing auto: the banner names the threshold; with every micro-batch above
    it (threshold 0) the trained weights equal those of a run that keeps its activations."""
    from safetensors.torch import load_file

    import polo.models.loading as loading
    from polo.rl.train import train

    def run(setting, name):
        train(
            tiny_rl_config(
                tiny_model_dir,
                tmp_path / name,
                task={"num_eval": 0},
                train={"steps": 2, "micro_batch_size": 4, "gradient_checkpointing": setting},
                output={"save_every": 0, "report_to": [], "plots": False},
            )
        )
        latest = sorted((tmp_path / name / "checkpoints").glob("step-*"))[-1]
        return load_file(str(latest / "model.safetensors"))

    kept = run(False, "kept")
    monkeypatch.setattr(loading, "AUTO_RECOMPUTE_SHARE", 0.0)  # threshold 0 tokens: every micro-batch recomputes
    recomputed = run("auto", "auto")
    assert "activations recomputed above 0 tokens a micro-batch" in capsys.readouterr().out
    assert kept.keys() == recomputed.keys()
    for name, weight in kept.items():
        torch.testing.assert_close(recomputed[name], weight, rtol=1e-4, atol=1e-6, msg=name)


def test_host_memory_is_shared_among_the_processes_torchrun_starts_on_the_host(monkeypatch):
    import polo.runtime.device as device

    monkeypatch.setattr(device, "host_available_memory", lambda: 8 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert device.Compute(torch.device("cpu")).available_memory() == 8 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks on this host: a quarter each
    assert device.Compute(torch.device("cpu")).available_memory() == 2 * 2**30
