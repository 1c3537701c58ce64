"""Old import paths of this release's layout change, kept for one release.

The package was regrouped by system (``claas_verl.claas`` for CLaaS, ``claas_verl.mopd`` for continual MOPD). A
recipe or a user's own code that names a module by its old path (``claas_verl.trainer.claas.sdpo_worker``,
``claas_verl.replay``, ...) still imports: the finder below answers the old name with the module at its new path
(the same module object, so ``isinstance`` checks and registries are unaffected) and warns once per name. Remove in
the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

# old prefix -> new prefix (longest first when resolving)
MOVED: dict[str, str] = {
    "claas_verl.replay": "claas_verl.claas.replay",
    "claas_verl.service": "claas_verl.claas.service",
    "claas_verl.envs": "claas_verl.claas.envs",
    "claas_verl.trainer.claas": "claas_verl.claas.trainer",
    "claas_verl.trainer.mopd": "claas_verl.mopd.trainer",
    "claas_verl.verl_ext.claas_losses": "claas_verl.claas.verl_losses",
    "claas_verl.verl_ext.lora_versions": "claas_verl.claas.lora_versions",
    "claas_verl.verl_ext.vllm_versioned_lora": "claas_verl.claas.vllm_versioned_lora",
    "claas_verl.verl_ext.distill_losses": "claas_verl.mopd.verl_losses",
    "claas_verl.data": "claas_verl.mopd.data",
    "claas_verl.eval": "claas_verl.mopd.eval",
    "claas_verl.merges": "claas_verl.mopd.merges",
    "claas_verl.envs.sandbox": "claas_verl.sandbox",
    "claas_verl.envs.code_reward": "claas_verl.sandbox.code_reward",
    "claas_verl.trainer.base": "claas_verl.verl_ext.trainer_base",
    "claas_verl.trainer.verl_couplings": "claas_verl.verl_ext.trainer_couplings",
}
# old packages that have no single new home: an empty package, so that their old children still resolve
EMPTY_PACKAGES = ("claas_verl.trainer",)


def new_name(old: str) -> str | None:
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix):]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str | None):
        self.target = target
        self.real_spec = None

    def create_module(self, spec):
        if self.target is None:
            module = types.ModuleType(spec.name, "Moved; see claas_verl._moved.")
            module.__path__ = []
            return module
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        # The target module already ran when it was imported; importlib has just set its __spec__ to the alias's,
        # which would misname it to pickling and reloading: give it back its own.
        if self.real_spec is not None:
            module.__spec__ = self.real_spec

    def get_code(self, fullname):  # ``python -m <old path>`` (runpy asks the loader for the code)
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in EMPTY_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _Alias(None), is_package=True)
        new = new_name(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=3)
        new_spec = importlib.util.find_spec(new)
        if new_spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new),
                                              is_package=new_spec.submodule_search_locations is not None)


def install() -> None:
    # First in line: an old package name is answered with the new package, whose __path__ the path finder would
    # otherwise search for the old children, running their files a second time under the old names.
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
