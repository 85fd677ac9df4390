"""FuRA (paper 16, workbench.methods.fura): the properties the paper states, on tiny layers."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from workbench import quant  # noqa: E402
from workbench.methods import fura  # noqa: E402


def _linear(out, cols, seed=0, bias=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(cols, out, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, cols, generator=g, dtype=dtype))
        if bias:
            lin.bias.copy_(torch.randn(out, generator=g, dtype=dtype))
    return lin


@pytest.mark.parametrize("shape,n", [((12, 8), 2), ((6, 12), 3), ((8, 8), 1), ((5, 12), 4)])
def test_exact_reconstruction_at_init(shape, n):
    lin = _linear(*shape, bias=True)
    f = fura.FuraLinear.from_linear(lin, n)
    assert torch.allclose(f.weight(), lin.weight, atol=1e-12, rtol=0)
    x = torch.randn(3, 7, shape[1], dtype=torch.float64)
    assert torch.allclose(f(x), lin(x), atol=1e-10, rtol=0)      # the blockwise forward too


def test_block_svd_is_eq1():
    w = torch.randn(10, 12, dtype=torch.float64)
    L, S, R = fura.block_svd(w, 3)
    assert L.shape == (10, 3, 4) and S.shape == (3, 4) and R.shape == (3, 4, 4)
    for j in range(3):
        wj = w[:, 4 * j: 4 * j + 4]
        assert torch.allclose(L[:, j] @ torch.diag(S[j]) @ R[j], wj, atol=1e-12)
        assert torch.allclose(L[:, j].T @ L[:, j], torch.eye(4, dtype=w.dtype), atol=1e-12)


def test_update_confined_to_span_of_frozen_U():
    """Any change of S and R moves block j inside span(U_j); a dense update does not."""
    lin = _linear(16, 12)
    f = fura.FuraLinear.from_linear(lin, 3)            # tall blocks: 16 x 4, span(U_j) is 4-dim
    U = fura.block_svd(lin.weight.detach(), 3)[0]
    with torch.no_grad():
        f.R.add_(torch.randn_like(f.R))
        f.S.mul_(torch.rand_like(f.S) + 0.5)
    delta = f.weight().detach() - lin.weight.detach()
    assert delta.norm() > 1
    assert fura.outside_span(delta, U) < 1e-12
    dense = torch.randn(16, 12, dtype=torch.float64)
    assert fura.outside_span(dense, U) > 0.5          # a random update leaves span(U_j)


def test_only_S_and_R_get_gradients_and_update_can_be_full_rank():
    lin = _linear(8, 8)
    f = fura.FuraLinear.from_linear(lin, 2)
    x = torch.randn(32, 8, dtype=torch.float64)
    f(x).pow(2).sum().backward()
    assert f.R.grad is not None and f.S.grad is not None
    assert all(not p.requires_grad for p in f.core.parameters())
    with torch.no_grad():
        f.R.add_(0.5 * torch.randn_like(f.R))
    delta = f.weight().detach() - lin.weight.detach()
    assert fura.numerical_rank(delta) == 8            # full rank, whatever LoRA's r would be


@pytest.mark.parametrize("out,cols,n", [(128, 128, 8), (384, 128, 8), (128, 384, 16), (6, 12, 1)])
def test_parameter_counts_equal_closed_forms(out, cols, n):
    lin = _linear(out, cols, dtype=torch.float32)
    f = fura.FuraLinear.from_linear(lin, n)
    k, b = min(out, cols // n), cols // n
    assert fura.trainable(f) == fura.fura_parameters(out, cols, n) == n * k * b + n * k
    from peft import LoraConfig, get_peft_model
    for dora in (False, True):
        m = nn.Sequential(_linear(out, cols, dtype=torch.float32))
        pm = get_peft_model(m, LoraConfig(r=4, target_modules=["0"], use_dora=dora))
        assert fura.trainable(pm) == fura.lora_parameters(out, cols, 4, dora)


def test_closest_factor_pair():
    assert fura.closest_factor_pair(128) == (8, 16)
    assert fura.closest_factor_pair(384) == (16, 24)
    assert fura.closest_factor_pair(7) == (1, 7)


def test_4bit_core_dequantizes_within_the_quantizer_bound():
    lin = _linear(64, 64, dtype=torch.float32)
    f = fura.FuraLinear.from_linear(lin, 4, core_bits=4, group_size=16)
    assert isinstance(f.core, quant.QuantLinear) and f.core.bits == 4
    L = fura.block_svd(lin.weight.detach().double(), 4)[0].reshape(64, -1).float()
    step = f.core.quantized().per_column(f.core.scale.detach())
    err = (f.core.dequantized() - L).abs()
    assert bool((err <= step / 2 + 1e-7).all())        # round to nearest: half a step at most
    assert err.max() > 0                                # and it is really quantized
    assert fura.trainable(f) == fura.fura_parameters(64, 64, 4)


def test_dense_weights_reads_peft_lora_and_dora():
    from peft import LoraConfig, get_peft_model
    for dora in (False, True):
        m = nn.Sequential(_linear(6, 5, dtype=torch.float32))
        pm = get_peft_model(m, LoraConfig(r=2, target_modules=["0"], use_dora=dora,
                                          init_lora_weights=False))
        x = torch.randn(4, 5)
        name = next(n for n, mod in pm.named_modules() if hasattr(mod, "get_delta_weight"))
        w = fura.dense_weights(pm, [name])[name].float()
        assert torch.allclose(pm(x), x @ w.T, atol=1e-5)


def test_apply_fura_freezes_the_rest_and_keeps_the_function():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.q_proj = nn.Linear(8, 8, bias=False)
            self.up_proj = nn.Linear(8, 16, bias=False)

        def forward(self, i):
            return self.up_proj(self.q_proj(self.emb(i)))

    torch.manual_seed(0)
    m = Tiny()
    i = torch.arange(10)
    y0 = m(i).detach()
    names = fura.apply_fura(m, ("q_proj", "up_proj"))
    assert names == ["q_proj", "up_proj"]
    assert torch.allclose(m(i), y0, atol=1e-5)
    assert {n for n, p in m.named_parameters() if p.requires_grad} == \
        {"q_proj.S", "q_proj.R", "up_proj.S", "up_proj.R"}
    full = Tiny()
    fura.full_finetune(full, ("q_proj",))
    assert {n for n, p in full.named_parameters() if p.requires_grad} == {"q_proj.weight"}


def test_o_proj_blocks_follow_the_heads_as_the_reference_script():
    """``--blocktt_factorize_by_head`` (on by default in the reference's scripts): o_proj's input
    in (num_heads, head_dim) blocks, every other projection in the closest factor pair. At
    lm-base's width 128 with 4 heads: o_proj (4, 32), the others (8, 16)."""
    from types import SimpleNamespace

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=4)
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self, p, nn.Linear(128, 128, bias=False))
            self.up_proj = nn.Linear(128, 384, bias=False)
            self.down_proj = nn.Linear(384, 128, bias=False)

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    shapes = {}
    for by_head in (True, False):
        torch.manual_seed(0)
        m = Attn()
        fura.apply_fura(m, targets, by_head=by_head)
        shapes[by_head] = {p: (getattr(m, p).n, getattr(m, p).b) for p in targets}
    assert shapes[True]["o_proj"] == (4, 32)
    assert shapes[False]["o_proj"] == (8, 16)
    for p in ("q_proj", "k_proj", "v_proj", "up_proj"):
        assert shapes[True][p] == shapes[False][p] == (8, 16)
    assert shapes[True]["down_proj"] == shapes[False]["down_proj"] == (16, 24)
    assert fura.head_block_count("model.layers.0.self_attn.o_proj", 128, 4) == 4
    assert fura.head_block_count("model.layers.0.self_attn.o_proj", 128, 4, by_head=False) == 8
    assert fura.head_block_count("model.layers.0.self_attn.q_proj", 128, 4) == 8
    with pytest.raises(ValueError):
        fura.head_block_count("o_proj", 130, 4)


def test_the_default_layout_is_the_reference_scripts():
    """FuRA-NIPS trains with ``--blocktt_factorize_by_head`` on by default
    (``commonsense/src/finetune_blocktt.py``, ``qfura_commonsense/src/finetune_qfura.py``), so
    ``convert_linear_to_btt`` (``fura/btt_layer.py``) cuts o_proj's input by head: apply_fura's
    default does too, and refuses a model whose head count it cannot read rather than falling
    back to the closest pair."""
    class Block(nn.Module):
        def __init__(self, heads):
            super().__init__()
            if heads:
                from types import SimpleNamespace
                self.config = SimpleNamespace(num_attention_heads=heads)
            self.o_proj = nn.Linear(128, 128, bias=False)
            self.up_proj = nn.Linear(128, 384, bias=False)

    m = Block(4)
    fura.apply_fura(m, ("o_proj", "up_proj"))
    assert (m.o_proj.n, m.o_proj.b) == (4, 32) and (m.up_proj.n, m.up_proj.b) == (8, 16)
    with pytest.raises(ValueError, match="num_attention_heads.*by_head=False"):
        fura.apply_fura(Block(None), ("o_proj",))
    m = Block(None)
    fura.apply_fura(m, ("o_proj", "up_proj"), by_head=False)       # asked for: the closest pair
    assert (m.o_proj.n, m.o_proj.b) == (8, 16)
    fura.apply_fura(Block(None), ("up_proj",))                      # no o_proj: no heads needed
