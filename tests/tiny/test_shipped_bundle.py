"""Shipped bundles (claas_verl/tiny/shipped.py): packed deterministically, unpacked only with the fingerprint their
record names, and preferred by ensure_gym over a 40-minute build unless a build is asked for."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from claas_verl.tiny import gym
from claas_verl.tiny.fingerprint import bundle_fingerprint
from claas_verl.tiny.shipped import BUNDLES_DIR_ENV, bundles_dir, pack_bundle, shipped, unpack_shipped


def _fake_gym_bundle(root, weight=b"\x01\x02"):
    (root / "student").mkdir(parents=True)
    (root / "student" / "model.safetensors").write_bytes(weight)
    (root / "data" / "spell").mkdir(parents=True)
    (root / "data" / "spell" / "train.parquet").write_bytes(b"PAR1 rows")
    (root / "manifest.json").write_text(json.dumps({"version": gym.GYM_VERSION, "seed": 0, "base_sft": {},
                                                    "build_seconds": 1.0}))
    return root


@pytest.fixture
def ships(tmp_path, monkeypatch):
    monkeypatch.setenv(BUNDLES_DIR_ENV, str(tmp_path / "bundles"))
    return tmp_path


def test_pack_then_unpack_gives_the_same_files_and_fingerprint(ships):
    root = _fake_gym_bundle(ships / "built")
    archive, record = pack_bundle(root, "gym", gym.GYM_VERSION, 0, "test")
    first = archive.read_bytes()
    pack_bundle(root, "gym", gym.GYM_VERSION, 0, "test")
    assert archive.read_bytes() == first  # no times, owners or order in the archive: one set of files, one archive
    found = shipped("gym", gym.GYM_VERSION, 0)
    assert found is not None and found[0] == archive and found[1]["fingerprint"] == bundle_fingerprint(root)
    unpack_shipped(*found, ships / "out")
    assert (ships / "out" / "student" / "model.safetensors").read_bytes() == b"\x01\x02"
    assert bundle_fingerprint(ships / "out") == bundle_fingerprint(root)
    assert shipped("gym", gym.GYM_VERSION, 1) is None  # another seed is not shipped


def test_an_archive_whose_files_are_not_its_records_fingerprint_is_refused(ships):
    archive, record = pack_bundle(_fake_gym_bundle(ships / "built"), "gym", gym.GYM_VERSION, 0, "test")
    other = _fake_gym_bundle(ships / "other", weight=b"\x09")
    pack_bundle(other, "gym", gym.GYM_VERSION, 0, "test")  # the archive now holds other weights ...
    record.write_text(json.dumps({**json.loads(record.read_text()),
                                  "fingerprint": bundle_fingerprint(ships / "built")}))  # ... under the old record
    with pytest.raises(ValueError, match="fingerprint.*damaged or was replaced"):
        unpack_shipped(*shipped("gym", gym.GYM_VERSION, 0), ships / "out")


def test_a_record_for_another_version_or_a_member_outside_the_bundle_is_refused(ships):
    archive, record = pack_bundle(_fake_gym_bundle(ships / "built"), "gym", gym.GYM_VERSION, 0, "test")
    record.write_text(json.dumps({**json.loads(record.read_text()), "seed": 3}))
    with pytest.raises(ValueError, match="expected version .* and seed 0"):
        shipped("gym", gym.GYM_VERSION, 0)
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        info = tarfile.TarInfo("../outside.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    archive.write_bytes(evil.getvalue())
    with pytest.raises(ValueError, match="not a plain file or folder inside the bundle"):
        unpack_shipped(archive, {"fingerprint": "x"}, ships / "out")
    assert not (ships / "outside.json").exists()


def test_ensure_gym_unpacks_the_shipped_bundle_instead_of_building_unless_asked(ships, monkeypatch):
    built = []
    monkeypatch.setattr(gym, "build_bundle", lambda root, seed: built.append(seed) or _fake_gym_bundle(root, b"\x07"))
    pack_bundle(_fake_gym_bundle(ships / "built"), "gym", gym.GYM_VERSION, 0, "test")
    paths = gym.ensure_gym(ships / "gym")
    assert built == [] and bundle_fingerprint(paths.root) == bundle_fingerprint(ships / "built")
    gym.ensure_gym(ships / "gym")  # current: neither unpacked nor built again
    assert built == []
    rebuilt = gym.ensure_gym(ships / "gym_rebuilt", build=True)
    assert built == [0] and (rebuilt.student / "model.safetensors").read_bytes() == b"\x07"


def test_the_repositorys_shipped_gym_bundle_matches_its_record(tmp_path, monkeypatch):
    monkeypatch.delenv(BUNDLES_DIR_ENV, raising=False)
    found = shipped("gym", gym.GYM_VERSION, 0)
    assert found is not None, f"no shipped gym bundle v{gym.GYM_VERSION} seed 0 in {bundles_dir()}"
    unpack_shipped(*found, tmp_path / "gym")
    manifest = json.loads((tmp_path / "gym" / "manifest.json").read_text())
    assert manifest["version"] == gym.GYM_VERSION and manifest["seed"] == 0
