"""fp32 training linears through oneDNN: the same outputs and gradients as torch's, installed only where they pay."""

import pytest
import torch

import polo.kernels as kernels
from conftest import build_tiny_model, tiny_llama, tiny_rl_config
from polo.kernels.cpu import linear
from polo.models.loading import enable_activation_checkpointing
from polo.runtime.device import Compute
from polo.runtime.rates import packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN matmul op")


def wide_llama(seed: int = 0):
    """A 2-layer Llama wide enough (hidden 64, MLP 128) for its projections to qualify; k/v (64 -> 32) do not."""
    return tiny_llama(seed, hidden_size=64, intermediate_size=128, tie_word_embeddings=False)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("inputs", "outputs"), [(96, 160), (160, 96)])
def test_onednn_linear_gives_torchs_output_and_gradients(bias, inputs, outputs):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(inputs, outputs, bias=bias)
    x = torch.randn(3, 40, inputs, generator=generator)[:, ::2]  # a strided view, as attention outputs can be
    grad = torch.randn(3, 20, outputs, generator=generator)
    results = []
    for forward in (
        lambda v: torch.nn.functional.linear(v, layer.weight, layer.bias),
        lambda v: linear.OneDnnLinear.apply(v, layer.weight, layer.bias),
    ):
        layer.zero_grad(set_to_none=True)
        v = x.clone().requires_grad_(True)
        out = forward(v)
        out.backward(grad)
        results.append((out.detach(), v.grad, layer.weight.grad, layer.bias.grad if bias else None))
    for expected, got in zip(*results, strict=True):
        if expected is None:
            assert got is None
            continue
        assert got.shape == expected.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_onednn_linear_skips_the_gradients_nobody_asked_for():
    layer = torch.nn.Linear(80, 80)
    layer.weight.requires_grad_(False)  # a frozen base layer (LoRA)
    x = torch.randn(5, 80, requires_grad=True)
    linear.OneDnnLinear.apply(x, layer.weight, layer.bias).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None


def test_use_onednn_linears_routes_only_wide_fp32_linears_and_not_twice():
    model = wide_llama()
    routed = linear.use_onednn_linears(model)
    names = {name for name, module in model.named_modules() if getattr(module, "_polo_onednn", False)}
    # per layer q, o (64 x 64), gate, up, down (64 x 128); the LM head (64 -> 97); k, v (64 -> 32) are too narrow
    assert routed == len(names) == 2 * 5 + 1
    assert not any(name.endswith(("k_proj", "v_proj")) for name in names)
    assert linear.use_onednn_linears(model) == routed  # counted again, not wrapped twice
    bf16 = wide_llama().to(torch.bfloat16)
    assert linear.use_onednn_linears(bf16) == 0


def test_a_routed_model_trains_as_torchs_does_with_and_without_recomputation():
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for routed in (False, True):
        for checkpointing in (False, True):
            model = wide_llama()
            if routed:
                linear.use_onednn_linears(model)
            if checkpointing:
                enable_activation_checkpointing(model)
            model.train()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    reference_loss, reference_grads = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_routed_layer_falls_back_to_torch_under_autocast_and_for_other_dtypes():
    model = wide_llama()
    linear.use_onednn_linears(model)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's cast, as F.linear has it
    with pytest.raises(RuntimeError):  # float64 input on fp32 weights: torch's own error, not a oneDNN one
        layer(x.double())


def test_sampling_and_scoring_take_a_routed_layer_over_for_their_block_and_give_it_back():
    model = wide_llama()
    linear.use_onednn_linears(model)
    layer = model.model.layers[0].mlp.down_proj
    routed_forward = layer.forward
    with linear.prepacked_linears(model, 8, fp32=True, bf16=False):
        assert layer.forward is not routed_forward
    assert layer.forward == routed_forward and layer._polo_onednn
    plain = torch.nn.Linear(64, 64)
    with linear.prepacked_linears(plain, 8, fp32=True, bf16=False):
        assert "forward" in plain.__dict__
    assert "forward" not in plain.__dict__  # a layer with no forward of its own gets none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_multiplies_q_k_v_and_gate_up_as_one_matmul_each_with_the_same_outputs(monkeypatch, dtype):
    if dtype is torch.bfloat16 and not linear._can_prepack():
        pytest.skip("this CPU has no native bf16: bf16 weights are not packed")
    model = wide_llama().to(dtype).eval()
    ids = torch.randint(2, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    calls = []
    real = linear.packed_linear
    monkeypatch.setattr(linear, "packed_linear", lambda x, **kw: calls.append(x.shape) or real(x, **kw))
    options = {"fp32": dtype is torch.float32, "bf16": dtype is torch.bfloat16}
    with torch.no_grad():
        with linear.prepacked_linears(model, 3, **options):
            merged = model(ids).logits
        merged_calls = list(calls)
        calls.clear()
        monkeypatch.setattr(linear, "MERGED_PROJECTIONS", ())
        with linear.prepacked_linears(model, 3, **options):
            apart = model(ids).logits
    # Per layer: q+k+v, o, gate+up, down merged, against 7 matmuls apart; then the LM head.
    assert len(merged_calls) == 2 * 4 + 1 and len(calls) == 2 * 7 + 1
    torch.testing.assert_close(merged, apart, **({"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {}))
    torch.testing.assert_close(merged.float(), model(ids).logits.float(), rtol=0.05, atol=0.05)  # no block: plain


def test_a_merged_projection_called_with_another_input_runs_its_own_weight_and_is_given_back_after():
    model = wide_llama().eval()
    attention = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        expected = {name: getattr(attention, name)(y) for name in ("q_proj", "k_proj", "v_proj")}
        with linear.prepacked_linears(model, 2, fp32=True, bf16=False):
            assert "forward" in attention.k_proj.__dict__
            attention.q_proj(x)  # the merged product for x
            k_other = attention.k_proj(y)  # another input: k's own weight
            k_x = attention.k_proj(x)  # x's slice, kept from the merged product
            v_x = attention.v_proj(x)
        torch.testing.assert_close(k_other, expected["k_proj"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_x, attention.k_proj(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_x, attention.v_proj(x), rtol=1e-5, atol=1e-5)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert "forward" not in getattr(attention, name).__dict__


@pytest.mark.parametrize(
    ("precision", "pays", "expected"), [("fp32", True, 11), ("fp32", False, 0), ("bf16_master", True, 0)]
)
def test_the_facade_routes_fp32_runs_only_where_onednn_measured_faster(monkeypatch, precision, pays, expected):
    monkeypatch.setattr(kernels, "packed_fp32_pays", lambda key: pays)
    model = wide_llama()
    if precision == "bf16_master":
        model = model.to(torch.bfloat16)
    assert kernels.use_onednn_linears(model, Compute.named(precision)) == expected


@pytest.mark.parametrize("kept", [False, True])  # backward recomputes the tiles' logits, or takes the forward's
@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_tiled_log_probs_through_onednn_give_torchs_values_and_gradients(monkeypatch, with_entropy, kept):
    from polo.kernels import logprobs

    monkeypatch.setattr(logprobs, "KEPT_LOGITS_BYTES", logprobs.KEPT_LOGITS_BYTES if kept else 0)

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 64, generator=generator)
    weight = torch.randn(300, 64, generator=generator) * 0.3
    targets = torch.randint(0, 300, (37,), generator=generator)
    # tiles of 16 tokens x 128 words: three vocabulary blocks, the last one short, and a short last chunk
    settings = logprobs.LogprobSettings(
        temperature=0.7, with_entropy=with_entropy, chunk_size=16, vocab_block=128, compute_dtype=torch.float32
    )
    results, calls = [], []
    real = logprobs.onednn_linear
    monkeypatch.setattr(logprobs, "onednn_linear", lambda *args: calls.append(1) or real(*args))
    for onednn in (False, True):
        monkeypatch.setattr(logprobs, "onednn_fp32_pays", lambda onednn=onednn: onednn)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        values, entropy = logprobs.ChunkedTokenLogprobs.apply(h, w, targets, settings)
        values.sum().backward()
        results.append((values.detach(), entropy, h.grad, w.grad))
        # 9 tiles forward, 9 again in backward unless the forward's are kept, and each of 3 vocabulary blocks' two
        # gradients
        assert len(calls) == ((9 if kept else 18) + 3 * 2 if onednn else 0)
    expected = torch.log_softmax(hidden @ weight.T / 0.7, dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(results[0][0], expected, rtol=1e-5, atol=1e-5)
    for plain, through_onednn in zip(*results, strict=True):
        torch.testing.assert_close(through_onednn, plain, rtol=1e-5, atol=1e-5)


def test_an_fp32_run_trains_and_scores_its_reference_through_onednn_where_it_pays(tmp_path, monkeypatch):
    """`polo train` in fp32 on a CPU that measured oneDNN faster: the update's linears and log-prob tiles (with
    gradient) and the KL reference's forward (without) all run through oneDNN, and the run learns as a run does."""
    import json

    import polo
    from polo.kernels import logprobs
    from polo.rl import step
    from polo.runtime.rates import MatmulRates

    rates = MatmulRates(fp32=200.0, bf16=150.0, cached=True, fp32_packed=450.0)
    monkeypatch.setattr(linear, "cached_rates", lambda: rates)
    linear.packed_fp32_pays.cache_clear()
    phases, phase, real_product, real_score = [], ["other"], linear.onednn_linear, step.score_completions

    def counted(where):
        def product(*args):
            phases.append((where, phase[0]))
            return real_product(*args)

        return product

    def scoring(*args, **kwargs):  # the reference's forward (beta > 0, one update epoch: nothing else is scored)
        phase[0] = "reference"
        try:
            return real_score(*args, **kwargs)
        finally:
            phase[0] = "other"

    monkeypatch.setattr(linear, "onednn_linear", counted("layers"))
    monkeypatch.setattr(logprobs, "onednn_linear", counted("head"))
    monkeypatch.setattr(step, "score_completions", scoring)
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, intermediate_size=128)
    config = tiny_rl_config(
        model_dir,
        tmp_path / "run",
        algorithm={"group_size": 4, "beta": 0.04},
        train={"steps": 2},
        output={"save_every": 0, "plots": False, "report_to": []},
        eval={"before": False, "after": False},
    )
    try:
        polo.train(config)
    finally:
        linear.packed_fp32_pays.cache_clear()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    # the layers and the head, in the reference's forward and in the update
    assert {(where, when) for where in ("layers", "head") for when in ("reference", "other")} <= set(phases)
