"""Parameters keep their storage: a captured CUDA graph (the static-cache sampler's decode step)
reads weights by address, so an optimizer step and the LoRA merge for sampling must write in place."""

from __future__ import annotations

import pytest
import torch

from polo.config import LoraSettings
from polo.models.loading import load_policy
from polo.models.lora import add_adapters, merged_for_sampling
from polo.models.precision import MasterWeights


def addresses(model: torch.nn.Module) -> dict[str, int]:
    return {name: parameter.data_ptr() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16_master"])
def test_an_optimizer_step_writes_the_weights_in_place(tiny_model_dir, masters):
    model, _ = load_policy(str(tiny_model_dir))
    master_weights = (
        MasterWeights(model) if masters else None
    )  # the cast to bf16 happens here, before addresses are taken
    optimizer = torch.optim.AdamW(master_weights.parameters if masters else model.parameters(), lr=1e-2, fused=True)
    if masters:
        master_weights.attach(optimizer)  # push: masters copied into the bf16 weights after every step
    before = addresses(model)
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    for _ in range(2):
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert addresses(model) == before
    assert any(
        not torch.equal(weights[name], parameter.detach()) for name, parameter in model.named_parameters()
    )  # it moved


def test_the_lora_merge_for_sampling_writes_into_the_base_weights_and_back(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    model = add_adapters(model, LoraSettings(r=4, alpha=8.0))
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)  # fresh adapters are zero: give them something to merge
    before = addresses(model)
    base = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    with merged_for_sampling(model) as sampler:
        inside = addresses(sampler)  # the plain model sampled from: its linear layers are the adapters' base layers
        assert any(name.endswith("q_proj.weight") for name in inside)
        assert set(inside.values()) <= set(before.values())  # no new storage anywhere
        name_at = {pointer: name for name, pointer in before.items()}
        changed = {
            name_at[p.data_ptr()]
            for p in sampler.parameters()
            if not torch.equal(base[name_at[p.data_ptr()]], p.detach())
        }
        assert changed and all("base_layer" in name for name in changed)  # the merge is in the base weights themselves
    assert addresses(model) == before
    assert all(
        torch.equal(base[name], parameter.detach()) for name, parameter in model.named_parameters()
    )  # bit for bit
