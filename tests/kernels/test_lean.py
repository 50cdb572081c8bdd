"""Lean RMSNorm, SwiGLU product and down projection: transformers' outputs bit for bit, its gradients, fewer saved
activations; norm outputs recomputed in backward."""

import contextlib
import gc
import weakref

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from conftest import tiny_llama, tiny_qwen2
from polo.kernels import norm_outputs_recomputed, use_lean_layers
from polo.kernels.cpu.native import native_ops
from polo.kernels.lean import LeanRMSNorm, Rotary, SiluMul, SwiGLUDown, torch_path
from polo.models.loading import enable_activation_checkpointing, load_policy


def saved_bytes(run) -> int:
    """Return the bytes of the tensors autograd keeps for backward while `run()` records its graph."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(sizes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lean_rmsnorm_is_transformers_forward_bit_for_bit_and_its_gradients(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    hidden = (torch.randn(3, 7, 48) * 3).to(dtype)
    grad = torch.randn(3, 7, 48).to(dtype)
    results = []
    for forward in (norm, lambda x: LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon)):
        x = hidden.clone().requires_grad_(True)
        norm.weight.grad = None
        with torch_path():  # the reference; polo's native kernels are held to it in test_native_norms.py
            out = forward(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, norm.weight.grad))
    (out, dx, dw), (lean_out, lean_dx, lean_dw) = results
    assert torch.equal(lean_out, out)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(lean_dx.float(), dx.float(), **tolerance)
    torch.testing.assert_close(lean_dw.float(), dw.float(), **tolerance)


def test_lean_rmsnorm_and_silu_mul_pass_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: LeanRMSNorm.apply(x, w, 1e-6), (x, weight))
    gate = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SiluMul.apply, (gate, up))


def test_lean_layers_keep_the_model_outputs_and_gradients_with_fewer_saved_activations(tiny_model_dir):
    plain, _ = load_policy(str(tiny_model_dir))
    lean, _ = load_policy(str(tiny_model_dir))
    layers = plain.config.num_hidden_layers
    attentions = layers if native_ops() is not None else 0  # the rotary embedding's kernel is native
    assert use_lean_layers(lean) == 2 * layers + 1 + layers + attentions  # two norms a layer, the final norm, the MLPs
    assert use_lean_layers(lean) == 3 * layers + 1 + attentions  # a second call wraps nothing twice
    ids = torch.randint(3, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for name, model in (("plain", plain), ("lean", lean)):
        with torch_path():  # the reference, bit for bit; test_native_norms.py compares the native kernels with it
            logits = model(input_ids=ids).logits
        logits.float().pow(2).mean().backward()
        outputs[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.to(torch.bfloat16)  # what bf16 training keeps: the norms' fp32 copies are what lean layers drop
        outputs[name + " saved"] = saved_bytes(lambda model=model: model(input_ids=ids).logits)
    assert torch.equal(outputs["lean"][0], outputs["plain"][0])
    for name, grad in outputs["plain"][1].items():
        torch.testing.assert_close(outputs["lean"][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert outputs["lean saved"] < 0.8 * outputs["plain saved"]


def test_a_norm_that_computes_something_else_keeps_its_forward():
    class OnePlusWeightNorm(LlamaRMSNorm):  # Gemma's: scaled by 1 + weight
        def forward(self, hidden_states):
            return super().forward(hidden_states) / self.weight * (1 + self.weight)

    norms = torch.nn.ModuleList([LlamaRMSNorm(8), OnePlusWeightNorm(8)])
    with torch.no_grad():
        for norm in norms:
            norm.weight.uniform_(0.5, 1.5)
    assert use_lean_layers(norms) == 1
    assert getattr(norms[0], "_polo_lean", False) and not getattr(norms[1], "_polo_lean", False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("native", [False, True])
def test_swiglu_down_is_the_down_projection_of_the_product_bit_for_bit(dtype, native):
    torch.manual_seed(0)
    gate, up = (torch.randn(2, 7, 48).to(dtype).requires_grad_(True) for _ in range(2))
    down = torch.nn.Linear(48, 24, bias=False).to(dtype)
    grad = torch.randn(2, 7, 24).to(dtype)
    results = []
    for forward in (lambda: down(SiluMul.apply(gate, up)), lambda: SwiGLUDown.apply(gate, up, down.weight)):
        with contextlib.nullcontext() if native else torch_path():
            out = forward()
            results.append((out.detach(), *torch.autograd.grad(out, (gate, up, down.weight), grad)))
    for plain, fused in zip(*results, strict=True):
        assert torch.equal(fused, plain)


def test_swiglu_down_passes_gradcheck_and_keeps_less_than_the_down_projection():
    torch.manual_seed(0)
    gate, up = (torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUDown.apply, (gate, up, weight))
    plain = saved_bytes(lambda: torch.nn.functional.linear(SiluMul.apply(gate, up), weight))
    fused = saved_bytes(lambda: SwiGLUDown.apply(gate, up, weight))
    assert fused == plain - gate.numel() * gate.element_size()  # the product is not kept


def test_a_down_projection_that_is_not_a_plain_linear_keeps_its_own_forward(tiny_model_dir):
    model, _ = load_policy(str(tiny_model_dir))
    use_lean_layers(model)
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.down_proj.register_forward_hook(
        lambda *_: calls.append(1)
    )  # a hook (as a LoRA or a profiler adds) sees its call
    model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert calls == [1]


def norm_outputs_alive(model, ids, scope) -> tuple[list[bool], dict]:
    """Run a forward of `model` within `scope`; return whether each attention norm's output is still held once the
    forward is over (while its graph is), and the parameters' gradients of the backward that follows."""
    outputs = []
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda _m, _i, out: outputs.append(weakref.ref(out)))
        for layer in model.model.layers
    ]
    with scope():
        loss = model(input_ids=ids).logits.float().pow(2).mean()
    gc.collect()
    alive = [ref() is not None for ref in outputs]
    loss.backward()
    for hook in hooks:
        hook.remove()
    return alive, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointed", [False, True])
def test_norm_outputs_are_recomputed_in_backward_with_the_same_gradients(tiny_model_dir, checkpointed):
    model, _ = load_policy(str(tiny_model_dir))
    use_lean_layers(model)
    model.to(torch.bfloat16)
    if checkpointed:
        enable_activation_checkpointing(model)
        model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    kept, plain = norm_outputs_alive(model, ids, contextlib.nullcontext)
    model.zero_grad(set_to_none=True)
    freed, scoped = norm_outputs_alive(model, ids, norm_outputs_recomputed)
    layers = model.config.num_hidden_layers
    if checkpointed:  # checkpointed layers keep only their inputs, within the scope or not
        assert kept == freed == [False] * layers
    else:
        assert kept == [True] * layers and freed == [False] * layers  # the projections kept the norm's output
    for name, grad in plain.items():
        assert torch.equal(scoped[name], grad), name


def test_a_norm_output_changed_in_place_is_kept_as_it_is_now():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(8)
    use_lean_layers(torch.nn.ModuleList([norm]))
    x, weight = torch.randn(3, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    grads = []
    for scope in (contextlib.nullcontext, norm_outputs_recomputed):
        with scope():
            hidden = norm(x)
            hidden.mul_(2)  # the norm's output is no longer what recomputing it gives
            out = torch.nn.functional.linear(hidden, weight)
        grads.append(torch.autograd.grad(out.sum(), weight)[0])
    assert torch.equal(grads[1], grads[0])


needs_native = pytest.mark.skipif(native_ops() is None, reason="polo's native CPU kernels do not build here")


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("halves_alike", [True, False])
def test_rotary_is_transformers_rotary_embedding_bit_for_bit_both_ways(dtype, halves_alike):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    rows, heads, dim = 11, 3, 16
    angles = torch.rand(rows, dim // 2 if halves_alike else dim, generator=generator) * 6
    angles = torch.cat((angles, angles), -1) if halves_alike else angles  # transformers' are alike; any pair works
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    states = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    grad = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    results = []
    for rotate in (
        lambda q: apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=1)[0],  # cos, sin (rows, 1, d) there
        lambda q: Rotary.apply(q, cos[:, None], sin[:, None]),
    ):
        q = states.clone().requires_grad_(True)
        out = rotate(q)
        out.backward(grad)
        results.append((out.detach(), q.grad))
    (out, dq), (native_out, native_dq) = results
    assert torch.equal(native_out, out)
    assert torch.equal(native_dq, dq)


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lean_attention_keeps_the_model_outputs_and_gradients_bit_for_bit(family, dtype, monkeypatch):
    model = (tiny_llama if family == "llama" else tiny_qwen2)().to(dtype)
    use_lean_layers(model)
    attentions = [layer.self_attn for layer in model.model.layers]
    assert all(getattr(attention, "_polo_lean", False) for attention in attentions)
    calls = []
    rotary = Rotary.apply
    monkeypatch.setattr(Rotary, "apply", staticmethod(lambda *args: calls.append(1) or rotary(*args)))
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for _ in ("lean", "own"):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        for attention in attentions:  # the second time round, every attention runs its module's own forward
            vars(attention).pop("forward", None)
    assert len(calls) == 2 * len(attentions)  # q and k of each layer, the first time round only
    (lean_logits, lean_grads), (logits, grads) = results
    assert torch.equal(lean_logits, logits)
    for name, grad in grads.items():
        assert torch.equal(lean_grads[name], grad), name


@needs_native
def test_an_attention_call_with_a_cache_runs_the_module_forward(monkeypatch):
    model = tiny_llama()
    use_lean_layers(model)
    calls = []
    rotary = Rotary.apply
    monkeypatch.setattr(Rotary, "apply", staticmethod(lambda *args: calls.append(1) or rotary(*args)))
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)  # the rotary kernel for q and for k, a layer
        assert len(calls) == 2 * model.config.num_hidden_layers
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False)
    assert len(calls) == 2 * model.config.num_hidden_layers  # sampling with a cache went through the module


def test_rotary_embedding_of_mixed_dtypes_is_transformers_own():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from polo.kernels.lean import rotary_embedding

    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(7, 8, generator=generator).repeat(1, 2) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    states = torch.randn(7, 3, 16, generator=generator)  # fp32, as a LoRA projection over bf16 weights returns
    expected = apply_rotary_pos_emb(states, states, cos, sin, unsqueeze_dim=1)[0]
    assert torch.equal(rotary_embedding(states, cos[:, None], sin[:, None]), expected)
