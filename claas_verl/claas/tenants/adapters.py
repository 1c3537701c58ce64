"""Each tenant's adapter: its lineage (versions 0, 1, 2, ...), the SHA-256 of its weights, and a store that keeps
idle tenants' adapters and optimizer states in host memory and swaps one into the training module for its update.

The trainer's engine holds ONE adapter (verl's LoRA engine is single-adapter; docs/verl-couplings.md): an update of
tenant ``t`` is :meth:`TenantAdapterStore.swap_in` (copy ``t``'s adapter into the module's LoRA parameters and its
AdamW state into the optimizer), the optimizer step(s), then :meth:`TenantAdapterStore.swap_out` (copy both back to
host memory; a changed adapter becomes ``t``'s next version). Between updates every tenant rests on the CPU.

The digest (:func:`adapter_digest`) is over the tensors' names (sorted), dtypes, shapes and bytes, so it names the
exact weights: equal digests, equal adapters bit for bit, whatever the device or the dict's order. Replies and
stats name it next to the version.

Checkpoints (:meth:`TenantAdapterStore.save`): one new file per tenant and save (``<tenant>/s<save>-v<version>.pt``:
adapter, optimizer state, lineage) and a ``manifest.json`` written atomically last, naming each tenant's file and
digest. A save killed part way leaves the previous manifest and the files it names, so a resume sees the previous
checkpoint whole; :meth:`load` re-hashes every adapter against the manifest.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from claas_verl.claas.tenants.config import check_tenant_names
from claas_verl.utils.files import atomic_write

MANIFEST = "manifest.json"
_FORMAT = 1


def adapter_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex digest of ``tensors``: for each name in sorted order, the name, dtype, shape and the raw bytes
    (row-major, the device's bits) of its tensor, each field length-prefixed so no two states hash alike."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        header = json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode()
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (header, raw):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
    return h.hexdigest()


def adapter_file_digest(path: str) -> str:
    """:func:`adapter_digest` of the peft adapter directory ``path`` (its ``adapter_model.safetensors``): what a
    serving engine loads, named by the bytes it reads."""
    from safetensors.torch import load_file

    file = os.path.join(str(path), "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} holds no adapter_model.safetensors: save the adapter with safe_serialization")
    return adapter_digest(load_file(file))


def _to_cpu(obj):
    """A deep copy of ``obj`` with every tensor copied to host memory (never a view of a device tensor)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class TenantAdapter:
    """One tenant at rest: ``adapter`` (name -> CPU tensor), ``optimizer`` (the optimizer's ``state_dict`` with CPU
    tensors; None before its first update) and ``lineage``: ``[(version, digest), ...]``, version 0 the initial
    adapter."""

    adapter: dict[str, torch.Tensor]
    optimizer: dict | None = None
    lineage: list[tuple[int, str]] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.lineage[-1][0]

    @property
    def digest(self) -> str:
        return self.lineage[-1][1]


def lora_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The module's trainable parameters by name: what one tenant owns (the LoRA A/B matrices under PEFT)."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


class TenantAdapterStore:
    """Every tenant's adapter, optimizer state and lineage in host memory; at most one tenant resident in the
    training module (:attr:`resident`).

    ``initial``: the adapter every tenant starts from (version 0), e.g. ``lora_parameters(model)`` right after the
    adapter was created; each tenant gets its own CPU copy.
    """

    def __init__(self, tenants, initial: Mapping[str, torch.Tensor]):
        self.tenants = check_tenant_names(tenants, "TenantAdapterStore tenants")
        if not initial:
            raise ValueError("the initial adapter is empty: build the store from the LoRA parameters of the model")
        base = {n: _to_cpu(t) for n, t in initial.items()}
        digest = adapter_digest(base)
        self._state = {t: TenantAdapter({n: v.clone() for n, v in base.items()}, None, [(0, digest)])
                       for t in self.tenants}
        self.resident: str | None = None

    def __getitem__(self, tenant: str) -> TenantAdapter:
        try:
            return self._state[tenant]
        except KeyError:
            raise KeyError(f"no tenant {tenant!r} in the adapter store; tenants: {list(self.tenants)}") from None

    def version(self, tenant: str) -> tuple[int, str]:
        """``(version, digest)`` of ``tenant``'s newest adapter."""
        s = self[tenant]
        return s.version, s.digest

    def swap_in(self, tenant: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Make ``tenant`` the resident: its adapter into ``module``'s trainable parameters (same names), its
        optimizer state into ``optimizer`` (a tenant before its first update starts with an empty state)."""
        if self.resident is not None:
            raise RuntimeError(f"tenant {self.resident!r} is still resident: swap_out before swapping in {tenant!r}")
        state = self[tenant]
        params = lora_parameters(module)
        if set(params) != set(state.adapter):
            missing, extra = sorted(set(state.adapter) - set(params)), sorted(set(params) - set(state.adapter))
            raise ValueError(f"tenant {tenant!r}: the module's trainable parameters differ from the stored adapter "
                             f"(missing in the module: {missing[:3]}, not in the adapter: {extra[:3]})")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state.adapter[name])
        optimizer.state.clear()
        if state.optimizer is not None:
            optimizer.load_state_dict(copy.deepcopy(state.optimizer))  # casts the state to the parameters' device
        self.resident = tenant

    def swap_out(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, str]:
        """Copy the resident tenant's adapter and optimizer state back to host memory and clear the optimizer
        state (no tenant's moments stay on the device); a changed adapter becomes its next version. Returns
        ``(version, digest)``."""
        tenant = self.resident
        if tenant is None:
            raise RuntimeError("no tenant is resident: swap_in first")
        state = self._state[tenant]
        adapter = {n: _to_cpu(p) for n, p in lora_parameters(module).items()}
        digest = adapter_digest(adapter)
        state.optimizer = _to_cpu(optimizer.state_dict())
        optimizer.state.clear()
        if digest != state.digest:
            state.adapter = adapter
            state.lineage.append((state.version + 1, digest))
        self.resident = None
        return state.version, state.digest

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str) -> str:
        """Write every tenant (see the module doc); returns the manifest's path. Idle tenants must not be
        resident (a resident tenant's newest weights live in the module)."""
        if self.resident is not None:
            raise RuntimeError(f"tenant {self.resident!r} is resident: swap_out before saving")
        os.makedirs(directory, exist_ok=True)
        # every save writes new file names (the save's index), so the files the previous manifest names are never
        # overwritten before the new manifest replaces it
        previous = os.path.join(directory, MANIFEST)
        index = 0
        if os.path.exists(previous):
            with open(previous) as f:
                index = int(json.load(f).get("save_index", -1)) + 1
        manifest = {"format": _FORMAT, "save_index": index, "tenants": {}}
        for tenant, state in self._state.items():
            rel = os.path.join(tenant, f"s{index}-v{state.version}.pt")
            payload = {"adapter": state.adapter, "optimizer": state.optimizer, "lineage": state.lineage}
            atomic_write(os.path.join(directory, rel), lambda f, payload=payload: torch.save(payload, f))
            manifest["tenants"][tenant] = {"file": rel, "version": state.version, "digest": state.digest}
        out = atomic_write(os.path.join(directory, MANIFEST),
                           lambda f: f.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
        for tenant in self._state:  # files of older versions: no manifest names them any more
            keep = os.path.basename(manifest["tenants"][tenant]["file"])
            for name in os.listdir(os.path.join(directory, tenant)):
                if name.endswith(".pt") and name != keep:
                    os.remove(os.path.join(directory, tenant, name))
        return out

    def load(self, directory: str) -> None:
        """Restore every tenant from :meth:`save`'s directory: same tenants, each adapter re-hashed against the
        manifest. All or nothing."""
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"{directory}/{MANIFEST}: not a tenant adapter checkpoint (format {_FORMAT})")
        saved = sorted(manifest["tenants"])
        if saved != sorted(self.tenants):
            raise ValueError(f"{directory}: the checkpoint holds tenants {saved}, this job has {list(self.tenants)}")
        restored = {}
        for tenant, entry in manifest["tenants"].items():
            payload = torch.load(os.path.join(directory, entry["file"]), map_location="cpu", weights_only=True)
            adapter = payload["adapter"]
            digest = adapter_digest(adapter)
            lineage = [(int(v), str(d)) for v, d in payload["lineage"]]
            if digest != entry["digest"] or lineage[-1] != (entry["version"], digest):
                raise ValueError(f"{directory}/{entry['file']}: the adapter hashes to {digest[:12]}, the manifest "
                                 f"says v{entry['version']} {entry['digest'][:12]}: the file is not the saved one")
            restored[tenant] = TenantAdapter(adapter, payload["optimizer"], lineage)
        self._state = {t: restored[t] for t in self.tenants}
        self.resident = None

    def host_bytes(self) -> dict[str, int]:
        """Bytes each tenant holds in host memory (adapter + optimizer state tensors)."""
        def nbytes(obj) -> int:
            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, dict):
                return sum(nbytes(v) for v in obj.values())
            if isinstance(obj, (list, tuple)):
                return sum(nbytes(v) for v in obj)
            return 0
        return {t: nbytes(s.adapter) + nbytes(s.optimizer) for t, s in self._state.items()}
