"""`polo.kernels` picks each kernel per device: the CPU's own paths on the CPU, SDPA and plain rows on CUDA.

A `Compute` on CUDA is only a description here (no GPU is needed to build one), so the choices
the façade makes for a GPU run are checked on any machine.
"""

from __future__ import annotations

import contextlib

import torch

from polo import kernels
from polo.kernels.cpu.attention import POLO_ATTENTION
from polo.models.loading import load_policy
from polo.runtime.device import CPU, Compute

CUDA = Compute(torch.device("cuda", 0), autocast_dtype=torch.bfloat16)


def test_fast_attention_is_polos_on_the_cpu_and_sdpa_on_cuda(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    assert model.config._attn_implementation == "sdpa"
    assert kernels.use_fast_attention(model, CUDA)  # SDPA already: flash / memory-efficient kernels on a GPU
    assert model.config._attn_implementation == "sdpa"
    assert kernels.use_fast_attention(model, CPU) and kernels.attends_blockwise(model)
    assert model.config._attn_implementation == POLO_ATTENTION
    assert kernels.use_fast_attention(model, CPU)  # a second call (the LoRA policy is its own reference) keeps it


def test_a_model_on_another_attention_is_left_alone(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir), attn_implementation="eager")
    assert not kernels.use_fast_attention(model, CPU) and not kernels.use_fast_attention(model, CUDA)
    assert model.config._attn_implementation == "eager"


def test_prepacking_and_prompt_sharing_are_cpu_only():
    linear = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
    assert isinstance(kernels.prepacked_linears(linear, 8, CUDA), contextlib.nullcontext)
    with kernels.prepacked_linears(linear, 8, CPU):  # on the CPU the oneDNN path (a no-op without native bf16)
        pass
    shape = dict(
        prompt_len=84, completion_len=64, group_size=8, hidden_size=576, params_per_layer=4.0e6, blockwise=True
    )
    assert kernels.sharing_pays(**shape, device=CPU.device)
    assert not kernels.sharing_pays(**shape, device=CUDA.device)


def test_the_shared_layout_is_built_on_the_batch_device():
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6]], device=CPU.device)
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1]], device=CPU.device)
    completion_ids = torch.tensor([[7, 8], [9, 2]], device=CPU.device)
    shared = kernels.share_prompts(prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), 2)
    assert {
        tensor.device
        for tensor in (shared.input_ids, shared.attention_mask, shared.position_ids, shared.predictor_index)
    } == {CPU.device}
