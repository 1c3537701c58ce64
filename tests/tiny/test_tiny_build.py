"""Bundle build: layout/manifest, byte-identical rebuilds, idempotent and locked ensure_tiny, CLI."""

import json
import threading

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import claas_verl.tiny.build as build
from claas_verl.tiny import ALL_DATA_DOMAINS, MOPD_DOMAINS, TINY_VERSION, ensure_tiny, make_tiny, read_manifest
from claas_verl.tiny.__main__ import main as cli

torch.set_num_threads(1)  # shared 2-core machine: avoid intra-op thread thrash during builds

# Files whose bytes must not depend on the build (everything except nothing: the manifest too).
MODEL_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module", autouse=True)
def quick_training():
    """Every bundle this module builds uses a few training steps instead of the real 150 + 40 (≈40 s a build):
    the checks here are about layout, determinism, locking and rebuild rules, which the step count does not
    change. The real bundle's content is checked in test_tiny_model.py."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "PRETRAIN", {**build.PRETRAIN, "steps": 3})
        mp.setattr(build, "EXPERT_FT", {**build.EXPERT_FT, "steps": 2})
        yield


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return ensure_tiny(tmp_path_factory.mktemp("shared") / "tiny")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("fresh") / "tiny", seed=0)


def _snapshot(paths):
    """{relative path: bytes} of every file of a bundle."""
    return {str(p.relative_to(paths.root)): p.read_bytes() for p in sorted(paths.root.rglob("*")) if p.is_file()}


def _count_builds(monkeypatch):
    calls = []
    real = build._build_into

    def counting(root, seed, arch="qwen2"):
        calls.append(seed)
        real(root, seed, arch)

    monkeypatch.setattr(build, "_build_into", counting)
    return calls


def test_layout_and_manifest(fresh):
    m = read_manifest(fresh.root)
    assert m["version"] == TINY_VERSION and m["seed"] == 0
    assert m["domains"] == list(MOPD_DOMAINS) == ["logic", "math", "code", "safety", "if"]
    assert m["data_domains"] == list(ALL_DATA_DOMAINS)
    assert m["paths"]["student"] == "student"
    assert m["paths"]["experts"] == {d: f"experts/{d}" for d in MOPD_DOMAINS}
    for d in ALL_DATA_DOMAINS:
        for split in ("train", "test"):
            rel = m["paths"]["data"][d][split]
            assert rel == f"data/{d}/{split}.parquet" and (fresh.root / rel).is_file()
            assert (fresh.root / rel) == getattr(fresh, split)[d]
    assert m["sizes"]["vocab_size"] == 1024
    assert m["sizes"]["train_rows"] >= 64 and m["sizes"]["test_rows"] >= 16
    assert len(pd.read_parquet(fresh.train["math"])) == m["sizes"]["train_rows"]
    assert m["tokens"]["eos_token_ids"] == [2, 0] and m["tokens"]["pad_token_id"] == 0
    for p in [fresh.student, *fresh.experts.values()]:
        assert all((p / f).is_file() for f in MODEL_FILES)
    assert fresh.rewards.is_file() and fresh.rewards.name == "rewards.py"


def test_rebuild_is_byte_identical(fresh, shared):
    # Two builds (different processes possibly, different directories) give the same bytes.
    assert _snapshot(fresh) == _snapshot(shared)


def test_seed_changes_weights_and_data_but_not_tokenizer_shape(fresh, tmp_path):
    other = make_tiny(tmp_path / "seed1", seed=1)
    a, b = load_file(fresh.student / "model.safetensors"), load_file(other.student / "model.safetensors")
    assert a.keys() == b.keys() and not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert not pd.read_parquet(fresh.train["logic"]).equals(pd.read_parquet(other.train["logic"]))
    assert read_manifest(other.root)["seed"] == 1
    # ensure_tiny with the wrong seed for this dir rebuilds it with the requested one
    assert read_manifest(ensure_tiny(other.root, seed=0).root)["seed"] == 0
    assert _snapshot(ensure_tiny(other.root, seed=0))["student/model.safetensors"] == \
        (fresh.student / "model.safetensors").read_bytes()


def test_ensure_is_idempotent(fresh, monkeypatch):
    calls = _count_builds(monkeypatch)
    before = _snapshot(fresh)
    mtime = fresh.manifest.stat().st_mtime_ns
    for _ in range(3):
        assert ensure_tiny(fresh.root) == fresh
    assert calls == [] and fresh.manifest.stat().st_mtime_ns == mtime and _snapshot(fresh) == before


def test_stale_or_incomplete_bundle_is_rebuilt(fresh, monkeypatch):
    calls = _count_builds(monkeypatch)
    before = _snapshot(fresh)
    m = json.loads(fresh.manifest.read_text())
    m["version"] = "0-stale"
    fresh.manifest.write_text(json.dumps(m))
    ensure_tiny(fresh.root)
    assert calls == [0] and _snapshot(fresh) == before
    (fresh.experts["code"] / "model.safetensors").unlink()  # a half-deleted bundle
    ensure_tiny(fresh.root)
    assert calls == [0, 0] and _snapshot(fresh) == before


def test_concurrent_ensure_builds_once(tmp_path, monkeypatch):
    calls = _count_builds(monkeypatch)
    target = tmp_path / "shared"
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny(target))
        except Exception as err:  # noqa: BLE001 - surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and calls == [0]
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert build.is_current(target)
    assert not list(tmp_path.glob(".shared.*"))  # no leftover temporary build directories


def test_make_refuses_to_clobber_unrelated_dir(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="--force"):
        make_tiny(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("content", ["a data file", "another bundle's manifest", "a plain file"])
def test_ensure_never_replaces_a_directory_that_is_not_a_tiny_bundle(tmp_path, monkeypatch, content):
    """CLAAS_TINY_DIR pointed at the wrong place: ensure_tiny refuses, naming the variable, and deletes nothing
    (it used to build a bundle and swap it in, removing whatever was there)."""
    calls = _count_builds(monkeypatch)
    target = tmp_path / "mine"
    if content == "a plain file":
        target.write_text("keep me")
    else:
        target.mkdir()
        name, text = (("precious.txt", "keep me") if content == "a data file" else
                      ("manifest.json", json.dumps({"version": "3", "seed": 0, "base_sft": {}})))  # the gym's
        (target / name).write_text(text)
    monkeypatch.setenv("CLAAS_TINY_DIR", str(target))
    with pytest.raises(FileExistsError, match="not a tiny bundle.*CLAAS_TINY_DIR"):
        ensure_tiny()
    assert calls == []
    kept = target.read_text() if target.is_file() else sorted(p.name for p in target.iterdir())
    assert kept in ("keep me", ["precious.txt"], ["manifest.json"])
    empty = tmp_path / "empty"
    empty.mkdir()
    ensure_tiny(empty)  # an empty directory is a place to build in
    assert calls == [0]


def test_cli_make_and_info(fresh, tmp_path, capsys, monkeypatch):
    calls = _count_builds(monkeypatch)
    assert cli(["make", str(fresh.root)]) == 0  # already current: nothing rebuilt
    assert calls == [] and "ready at" in capsys.readouterr().out
    assert cli(["make", str(fresh.root), "--force"]) == 0
    assert calls == [0]
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    assert cli(["make", str(tmp_path / "junk")]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli(["info", str(fresh.root)]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == TINY_VERSION
    assert cli(["info", str(tmp_path / "nothing")]) == 1


def test_default_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CLAAS_TINY_DIR", str(tmp_path / "x"))
    assert build.default_dir() == tmp_path / "x"
    monkeypatch.delenv("CLAAS_TINY_DIR")
    assert str(build.default_dir()) == "/tmp/claas_verl_tiny"


def test_qwen3_variant_shares_data_and_tokenizer_and_is_its_own_bundle(fresh, tmp_path):
    qwen3 = make_tiny(tmp_path / "qwen3", arch="qwen3")
    assert read_manifest(qwen3.root)["arch"] == "qwen3" and "arch" not in read_manifest(fresh.root)
    config = json.loads((qwen3.student / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32  # vLLM's CPU kernels need >= 32
    weights = load_file(qwen3.experts["math"] / "model.safetensors")
    assert "model.layers.0.self_attn.q_norm.weight" in weights and "model.layers.0.self_attn.k_norm.weight" in weights
    same, theirs = _snapshot(fresh), _snapshot(qwen3)
    for rel in [*(f"data/{d}/{s}.parquet" for d in ALL_DATA_DOMAINS for s in ("train", "test")),
                "student/tokenizer.json"]:
        assert same[rel] == theirs[rel], rel
    assert build.is_current(qwen3.root, arch="qwen3") and not build.is_current(qwen3.root)
    with pytest.raises(FileExistsError, match="arch qwen2"):
        make_tiny(qwen3.root)  # a qwen2 build never silently replaces it
