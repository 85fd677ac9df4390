"""The tiny ViT for digits (models/vit.py)."""
import torch

from workbench.models import vit


def test_vit_reads_images_or_flat_pixels_and_names_its_block_linears():
    torch.manual_seed(0)
    net = vit.TinyViT(dim=16, depth=2, heads=2, mlp=32)
    x = torch.rand(5, 8, 8)
    out = net(x)
    assert out.shape == (5, 10) and torch.equal(out, net(x.reshape(5, 64)))
    names = sorted(vit.block_linears(net))
    assert names == sorted(f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "fc1", "fc2"))
    y = out.argmax(-1)
    assert vit.accuracy(net, x, y, batch=2) == 1.0 and vit.accuracy(net, x, (y + 1) % 10) == 0.0
