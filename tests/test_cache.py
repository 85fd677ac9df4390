"""The one cache (workbench.cache): content keys, and one locked, atomic build."""
import multiprocessing as mp
import time

import pytest

from workbench import cache


def test_key_covers_every_part_and_is_stable():
    k = cache.key("a", [1, 2], {"x": 1})
    assert k == cache.key("a", [1, 2], {"x": 1}) and len(k) == 12
    assert k != cache.key("a", [2, 1], {"x": 1}) != cache.key("a", [1, 2], {"x": 2})
    # the key of the former finetune.cache_key: cached fine-tunes keep their folders
    assert k == "f0b556bec02b"


def test_folder_lives_under_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    assert cache.root() == tmp_path
    f = cache.folder("zoo", "clip")
    assert f == tmp_path / "zoo" / "clip" and f.is_dir()


def test_build_builds_once_and_force_replaces(tmp_path):
    calls = []

    def make(tmp):
        calls.append(tmp)
        (tmp / "value.txt").write_text(str(len(calls)))
        return {"n": len(calls)}

    where = tmp_path / "thing"
    assert cache.build(where, make) == (where, True)
    assert cache.build(where, make) == (where, False)       # cached: not built again
    assert len(calls) == 1 and (where / "value.txt").read_text() == "1"
    assert cache.is_built(where)
    cache.build(where, make, force=True)                    # rebuilt, the old entry replaced
    assert len(calls) == 2 and (where / "value.txt").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing", "thing.lock"]   # no leftovers


def test_a_failed_build_leaves_nothing_behind_and_is_not_read(tmp_path):
    def broken(tmp):
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("out of memory")

    where = tmp_path / "thing"
    with pytest.raises(RuntimeError):
        cache.build(where, broken)
    assert not where.exists() and not cache.is_built(where)
    assert [p.name for p in tmp_path.iterdir()] == ["thing.lock"]


def test_ready_file_written_by_make_is_kept(tmp_path):
    def make(tmp):
        (tmp / "card.json").write_text('{"mine": 1}')
        return {"ignored": True}

    path, built = cache.build(tmp_path / "m", make, ready="card.json")
    assert built and (path / "card.json").read_text() == '{"mine": 1}'
    assert not (path / "done.json").exists()


def _slow_build(where: str, log: str) -> None:
    def make(tmp):
        with open(log, "a") as f:
            f.write("built\n")
        time.sleep(1.0)
        return {}
    cache.build(where, make)


def test_two_processes_build_once(tmp_path):
    where, log = str(tmp_path / "shared"), str(tmp_path / "log.txt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_slow_build, args=(where, log)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert open(log).read() == "built\n" and cache.is_built(tmp_path / "shared")


def test_remove_deletes_the_entry_and_its_lock(tmp_path):
    path, _ = cache.build(tmp_path / "x", lambda tmp: {})
    cache.remove(path)
    assert list(tmp_path.iterdir()) == []


def test_a_shipped_entry_is_copied_not_built(tmp_path, monkeypatch):
    """A zoo entry the checkout ships (data/zoo) is copied into the cache, never made; ``force``
    makes it anyway, and an entry outside the zoo is never looked for there."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "shipped_root", lambda: tmp_path / "shipped")
    src = tmp_path / "shipped" / "adapters" / "pool-smoke-abc"
    src.mkdir(parents=True)
    (src / "card.json").write_text('{"from": "shipped"}')
    calls = []

    def make(tmp):
        calls.append(tmp)
        (tmp / "card.json").write_text('{"from": "made"}')

    where = cache.folder("zoo", "adapters") / "pool-smoke-abc"
    assert cache.shipped(where, "card.json") == src
    assert cache.build(where, make, ready="card.json") == (where, False)
    assert calls == [] and (where / "card.json").read_text() == '{"from": "shipped"}'
    assert cache.build(where, make, ready="card.json", force=True) == (where, True)
    assert len(calls) == 1 and '"made"' in (where / "card.json").read_text()
    # not shipped at this key, or the zoo's copy looked for outside the zoo: made as before
    assert cache.shipped(cache.folder("zoo") / "other-smoke-abc", "card.json") is None
    assert cache.shipped(cache.folder("10-hestia") / "pool-smoke-abc", "card.json") is None


def test_a_shipped_smoke_entry_is_copied_and_every_entry_is_noted(tmp_path, monkeypatch):
    """A notebook's derived entry (data/smoke, laid out as the cache; under the zoo's folder too)
    is copied, never made; the process notes each entry asked for and how it was got."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "shipped_root", lambda: tmp_path / "zoo-shipped")
    monkeypatch.setattr(cache, "smoke_root", lambda: tmp_path / "smoke")
    for rel in ("16-fura/full-x", "zoo/inducekv/l2p-x"):
        (tmp_path / "smoke" / rel).mkdir(parents=True)
        (tmp_path / "smoke" / rel / "done.json").write_text('{"from": "shipped"}')
    calls = []
    make = lambda tmp: calls.append(tmp) or {"from": "made"}          # noqa: E731
    fine_tune = cache.folder("16-fura") / "full-x"
    stream = cache.folder("zoo", "inducekv") / "l2p-x"
    assert cache.build(fine_tune, make) == (fine_tune, False)
    assert cache.build(stream, make) == (stream, False)
    assert cache.build(fine_tune, make) == (fine_tune, False)          # now in the cache
    fresh = cache.build(cache.folder("16-fura") / "lora-y", make)[0]   # not shipped: made
    assert len(calls) == 1 and "made" in (fresh / "done.json").read_text()
    assert "shipped" in (stream / "done.json").read_text()
    noted = {e["entry"]: e["how"] for e in cache.entries()}
    assert noted["16-fura/full-x"] == "copied" and noted["zoo/inducekv/l2p-x"] == "copied"
    assert noted["16-fura/lora-y"] == "built"
    cache.build(tmp_path / "elsewhere", make)                         # outside the cache
    assert not any("elsewhere" in e["entry"] for e in cache.entries())
