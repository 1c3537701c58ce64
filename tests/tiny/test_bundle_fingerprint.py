"""claas_verl.tiny.fingerprint: a bundle's identity changes with its content, and only with its content."""

from __future__ import annotations

import json
import shutil

import pytest

from claas_verl.tiny.fingerprint import bundle_fingerprint


@pytest.fixture()
def bundle(tmp_path):
    root = tmp_path / "bundle"
    (root / "student").mkdir(parents=True)
    (root / "data" / "spell").mkdir(parents=True)
    (root / "student" / "model.safetensors").write_bytes(bytes(range(64)))
    (root / "student" / "config.json").write_text('{"hidden_size": 32}')
    (root / "data" / "spell" / "test.parquet").write_bytes(b"PAR1 rows")
    (root / "manifest.json").write_text(json.dumps({"version": "2", "seed": 0, "build_seconds": 461.1}))
    return root


def _edit_manifest(root, **changes):
    m = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**m, **changes}, indent=2))


def test_a_copy_or_another_build_time_is_the_same_bundle(bundle, tmp_path):
    fp = bundle_fingerprint(bundle)
    assert len(fp) == 16 and int(fp, 16) >= 0
    copy = tmp_path / "elsewhere"
    shutil.copytree(bundle, copy)
    assert bundle_fingerprint(copy) == fp  # the directory's name is not part of it
    _edit_manifest(copy, build_seconds=9.0)  # and neither the build's wall-clock time nor the JSON layout
    assert bundle_fingerprint(copy) == fp
    (copy / "student.lock").write_text("")  # files a run leaves beside the bundle
    (copy / "student" / "__pycache__").mkdir()
    (copy / "student" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert bundle_fingerprint(copy) == fp


@pytest.mark.parametrize("change", ["weight", "data", "config", "version", "renamed"])
def test_any_content_change_is_another_bundle(bundle, change):
    fp = bundle_fingerprint(bundle)
    if change == "weight":
        raw = bytearray((bundle / "student" / "model.safetensors").read_bytes())
        raw[10] ^= 1
        (bundle / "student" / "model.safetensors").write_bytes(bytes(raw))
    elif change == "data":
        (bundle / "data" / "spell" / "test.parquet").write_bytes(b"PAR1 other rows")
    elif change == "config":
        (bundle / "student" / "config.json").write_text('{"hidden_size": 64}')
    elif change == "version":
        _edit_manifest(bundle, version="3")
    else:  # the same bytes under another domain's name
        (bundle / "data" / "spell").rename(bundle / "data" / "reverse")
    assert bundle_fingerprint(bundle) != fp


def test_a_directory_without_a_manifest_is_refused_with_the_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a built bundle.*python -m claas_verl.tiny"):
        bundle_fingerprint(tmp_path)


def test_the_built_gym_bundle_has_a_stable_fingerprint(tmp_path):
    """On a real (reduced) bundle layout: the gym test split and a saved model, fingerprinted twice."""
    from claas_verl.tiny import gym
    from claas_verl.tiny.model import build_student, save_model
    from claas_verl.tiny.tokenizer import EOT_TOKEN, IM_END, special_token_ids
    from claas_verl.utils.prompt_rows import write_parquet

    tok = gym.byte_tokenizer()
    ids = special_token_ids(tok)
    save_model(build_student(len(tok), [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN], 0), tok, tmp_path / "student")
    write_parquet(gym.gym_rows(gym.GYM_DOMAINS[0], seed=0)[1], tmp_path / "data" / "spell" / "test.parquet")
    (tmp_path / "manifest.json").write_text(json.dumps({"version": gym.GYM_VERSION, "seed": 0}))
    fp = bundle_fingerprint(tmp_path)
    save_model(build_student(len(tok), [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN], 0), tok, tmp_path / "student")
    assert bundle_fingerprint(tmp_path) == fp  # saving the same weights again writes the same bytes
    save_model(build_student(len(tok), [ids[IM_END], ids[EOT_TOKEN]], ids[EOT_TOKEN], 1), tok, tmp_path / "student")
    assert bundle_fingerprint(tmp_path) != fp
