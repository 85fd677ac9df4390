"""The zoo's mini-CLIP (workbench.models.clip) and its image-caption data (workbench.data.images)."""
import math
from dataclasses import replace

import numpy as np
import pytest

from workbench.data import images

torch = pytest.importorskip("torch")

from workbench.models import clip  # noqa: E402

TINY = clip.ClipSize(dim=16, vision_layers=1, text_layers=1, heads=2, mlp=32, proj=8, steps=3,
                     n_per_class=2)


def test_info_nce_is_symmetric_and_matches_a_hand_computed_case():
    L = torch.tensor([[2.0, 0.0], [1.0, 3.0]])
    # image->text rows: -log softmax at the diagonal; text->image: the same on L^T
    i2t = -(math.log(math.exp(2) / (math.exp(2) + 1)) + math.log(math.exp(3) / (math.exp(1) + math.exp(3)))) / 2
    t2i = -(math.log(math.exp(2) / (math.exp(2) + math.exp(1))) + math.log(math.exp(3) / (1 + math.exp(3)))) / 2
    assert float(clip.info_nce(L)) == pytest.approx((i2t + t2i) / 2, rel=1e-6)
    assert float(clip.info_nce(L.T)) == pytest.approx(float(clip.info_nce(L)), rel=1e-6)
    # perfect alignment with a large scale gives a loss near 0; a shuffle gives a large one
    assert float(clip.info_nce(50 * torch.eye(4))) < 1e-6
    assert float(clip.info_nce(50 * torch.eye(4)[[1, 0, 3, 2]])) > 10


def test_info_nce_agrees_with_transformers_clip_loss():
    tok = clip.tokenizer()
    m = clip.make_model(TINY, len(tok)).eval()
    x, _, caps = images.shapes(images.SHAPES_SEEN[:5], 1, seed=0)
    with torch.no_grad():
        out = m(pixel_values=torch.as_tensor(x), return_loss=True, **clip.tokenize(tok, caps))
    assert float(clip.info_nce(out.logits_per_image)) == pytest.approx(float(out.loss), rel=1e-5)


def test_encoders_shapes_and_normalisation():
    tok = clip.tokenizer()
    m = clip.make_model(TINY, len(tok)).eval()
    x, y, caps = images.shapes(images.SHAPES_SEEN[:3], 2, seed=0)
    with torch.no_grad():
        fi = clip.image_features(m, x)
        ft = clip.text_features(m, tok, caps)
        fc = clip.class_features(m, tok, images.SHAPES_SEEN[:3], templates=(0, 1))
        lg = clip.zero_shot_logits(m, tok, x, images.SHAPES_SEEN[:3])
    assert fi.shape == (6, TINY.proj) and ft.shape == (6, TINY.proj) and fc.shape == (3, TINY.proj)
    assert lg.shape == (6, 3)
    assert torch.allclose(fi.norm(dim=-1), torch.ones(6), atol=1e-5)
    # every caption tokenises without <unk> and ends with <eos> before padding
    ids = clip.tokenize(tok, caps)["input_ids"]
    assert (ids != tok.unk_token_id).all()
    lengths = clip.tokenize(tok, caps)["attention_mask"].sum(1)
    assert all(ids[i, n - 1] == tok.eos_token_id for i, n in enumerate(lengths.tolist()))


def test_shapes_generator_is_deterministic_per_seed_and_heldout_is_disjoint():
    a = images.shapes(images.SHAPES_SEEN[:4], 3, seed=5)
    b = images.shapes(images.SHAPES_SEEN[:4], 3, seed=5)
    c = images.shapes(images.SHAPES_SEEN[:4], 3, seed=6)
    assert np.array_equal(a[0], b[0]) and a[2] == b[2] and not np.array_equal(a[0], c[0])
    assert a[0].shape == (12, 3, images.SIZE, images.SIZE) and 0 <= a[0].min() and a[0].max() <= 1
    seen, held = set(images.SHAPES_SEEN), set(images.SHAPES_HELDOUT)
    assert not seen & held and seen | held == set(images.SHAPES_CLASSES)
    assert len(images.SHAPES_CLASSES) >= 50 and len(held) >= 10
    # every attribute value stays seen, so held-out classes are new compositions of seen words
    for k, values in enumerate((images.TEXTURES, images.COLOURS, images.SHAPES)):
        assert {n.split()[k] for n in seen} == set(values)
    # different classes render differently (mean colour per class differs)
    x, y, _ = images.shapes(images.SHAPES_CLASSES[:12], 4, seed=0)
    means = np.stack([x[y == k].mean(0).ravel() for k in range(12)])
    assert np.linalg.matrix_rank(means) == 12


def test_digits_split_is_disjoint_and_captions_name_the_class():
    xtr, ytr, ctr = images.digits("train")
    xte, yte, cte = images.digits("test")
    assert len(xtr) + len(xte) == 1797 and xtr.shape[1:] == (3, images.SIZE, images.SIZE)
    assert all(images.DIGIT_NAMES[k] in c for k, c in zip(ytr, ctr))
    xa, _, _ = images.digits("all")
    flat = {r.tobytes() for r in xtr.reshape(len(xtr), -1)}
    assert sum(r.tobytes() in flat for r in xte.reshape(len(xte), -1)) < 0.05 * len(xte)


def test_add_noise_is_seeded_clipped_and_shifts_the_images():
    x, _, _ = images.digits("test")
    a, b = images.add_noise(x, 0.35, 5), images.add_noise(x, 0.35, 5)
    assert torch.equal(a, b) and not torch.equal(a, images.add_noise(x, 0.35, 6))
    assert float(a.min()) >= 0 and float(a.max()) <= 1
    assert float((a - torch.as_tensor(x)).abs().mean()) > 0.1
    assert torch.equal(images.add_noise(x, 0.0, 5), torch.as_tensor(x))


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    s = replace(TINY, steps=2)
    path = clip.ensure("smoke", sizes=s)
    card = (path / "card.json").read_text()
    m1, tok = clip.load("smoke", sizes=s)
    mtime = (path / "done.json").stat().st_mtime
    m2, _ = clip.load("smoke", sizes=s)            # cached: not rebuilt
    assert (path / "done.json").stat().st_mtime == mtime and (path / "card.json").read_text() == card
    x, _, caps = images.shapes(images.SHAPES_SEEN[:2], 2, seed=1)
    with torch.no_grad():
        assert torch.equal(clip.image_features(m1, x), clip.image_features(m2, x))
        assert torch.equal(clip.text_features(m1, tok, caps), clip.text_features(m2, tok, caps))
    assert m1.zoo_card["parameters"] == sum(p.numel() for p in m1.parameters())
    assert clip.model_dir("smoke", replace(s, seed=1)) != path      # the key covers the sizes
    assert [c["path"] for c in clip.list_built()] == [str(path)]


def test_build_trains_on_one_thread_whatever_the_caller_uses(tmp_path, monkeypatch):
    # a 2-thread build's weights differ from a 1-thread build's (and ran 3.4x slower beside a
    # second build), so the key alone would not say which model a cache holds
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    seen = []
    real_train = clip._train
    monkeypatch.setattr(clip, "_train", lambda s, **kw: (seen.append(torch.get_num_threads()),
                                                         real_train(s, **kw))[1])
    torch.set_num_threads(2)
    try:
        path = clip.ensure("smoke", sizes=replace(TINY, steps=1))
        assert seen == [clip.BUILD_THREADS] and torch.get_num_threads() == 2   # restored
    finally:
        torch.set_num_threads(before)
    import json
    assert json.loads((path / "card.json").read_text())["torch_threads"] == clip.BUILD_THREADS
