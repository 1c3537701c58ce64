"""Hugging Face model directories as lazy state dicts, and saving a merge in the base's layout.

:class:`SafetensorsDir` reads ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` one tensor at a time (memory-mapped), so the merges of
:mod:`claas_verl.mopd.merges.ties` hold one parameter of each model at a time. Keys are those stored
in the files: tied weights (e.g. ``lm_head`` tied to ``embed_tokens``) appear once, as saved.

:func:`save_like` writes ``(name, tensor)`` pairs into OUT with the template directory's shard
layout, flushing each shard as soon as all its tensors arrived, then copies every non-weight
file of the template (config, generation config, tokenizer files, chat template).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


def _layout(model_dir: Path) -> dict[str, str]:
    """Tensor name → file name (relative to ``model_dir``)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / SINGLE_FILE
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise ValueError(f"{model_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}: give a Hugging Face model directory "
                     "saved with safetensors (save_pretrained(..., safe_serialization=True))")


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """Read-only lazy state dict of a Hugging Face model directory (safetensors, single file or sharded)."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise ValueError(f"model directory {self.dir} does not exist")
        self.layout = _layout(self.dir)
        self._handles: dict[str, object] = {}

    def _handle(self, fname: str):
        if fname not in self._handles:
            from safetensors import safe_open

            self._handles[fname] = safe_open(str(self.dir / fname), framework="pt")
        return self._handles[fname]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handle(self.layout[key]).get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_like(template_dir: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
              out_dir: str | os.PathLike) -> Path:
    """Save ``tensors`` into ``out_dir`` with ``template_dir``'s safetensors layout and its non-weight files.

    ``out_dir`` must not exist or be empty. When every float tensor written has one dtype that differs
    from the template config's ``dtype``/``torch_dtype``, those config fields are updated to it, so
    ``from_pretrained(..., dtype="auto")`` loads the merge in the dtype it was stored in.
    """
    from safetensors.torch import save_file

    template, out = Path(template_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not empty; choose a new --out")
    if out.resolve() == template.resolve():
        raise ValueError("the output directory must differ from the template (base) directory")
    layout = _layout(template)
    pending: dict[str, set[str]] = {}
    for k, f in layout.items():
        pending.setdefault(f, set()).add(k)
    out.mkdir(parents=True, exist_ok=True)
    buffers: dict[str, dict[str, torch.Tensor]] = {f: {} for f in pending}
    float_dtypes: set[torch.dtype] = set()
    total_size = 0
    for key, t in tensors:
        if key not in layout:
            raise ValueError(f"tensor {key!r} is not in the template's layout ({template}); cannot place it")
        f = layout[key]
        t = t.detach().contiguous()
        if t.is_floating_point():
            float_dtypes.add(t.dtype)
        total_size += t.numel() * t.element_size()
        buffers[f][key] = t
        pending[f].discard(key)
        if not pending[f]:  # shard complete: write and free it
            save_file(buffers.pop(f), str(out / f), metadata={"format": "pt"})
    missing = sorted(k for ks in pending.values() for k in ks)
    if missing:
        raise ValueError(f"the merge produced no tensor for {missing[:5]} (+{max(len(missing) - 5, 0)} more)")
    if (template / INDEX_FILE).exists():
        index = json.loads((template / INDEX_FILE).read_text())
        index.setdefault("metadata", {})["total_size"] = total_size
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for p in template.iterdir():  # config, generation config, tokenizer and chat-template files
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != INDEX_FILE:
            shutil.copy2(p, out / p.name)
    cfg_path = out / "config.json"
    if len(float_dtypes) == 1 and cfg_path.exists():
        name = _DTYPE_NAMES.get(next(iter(float_dtypes)))
        cfg = json.loads(cfg_path.read_text())
        changed = False
        for field in ("dtype", "torch_dtype"):
            if name and field in cfg and cfg[field] != name:
                cfg[field] = name
                changed = True
        if changed:
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
