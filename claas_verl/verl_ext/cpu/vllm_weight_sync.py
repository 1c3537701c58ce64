"""Full-weight syncs into vLLM's CPU build: keep the linear layers' weights (docs/verl-couplings.md, V4).

After loading, vLLM's CPU backend post-processes every unquantized linear layer
(``UnquantizedLinearMethod.process_weights_after_loading`` calls
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``): it builds a packed
GEMM from the weight (oneDNN, the SGL AMX kernel, or zentorch), routes the layer's forward through it
(``layer.cpu_linear``) and replaces ``layer.weight`` by an empty parameter without a ``weight_loader``. verl's
full-weight sync loads the new weights into the model in place (``model.load_weights``, bucket by bucket) and then
runs ``process_weights_after_loading`` once more; on the CPU build the first fused q/k/v weight it meets has no
loader left, and the sync dies with ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``.

:func:`keep_cpu_linear_weights` makes that dispatch keep the weight (``remove_weight=False``, what vLLM already does
for its embedding and LM-head layers). The in-place load then writes into the kept weight, and verl's
``process_weights_after_loading`` after the sync packs the GEMM again from the new values, so the served model is
the synced one. Cost: every linear weight is held twice (the weight and its packed copy); this is a CPU-only path
(the function it wraps is only called on vLLM's CPU platform), meant for tests and small models.

Installed by the verl plugin (:mod:`claas_verl.verl_ext.plugin`) as a post-import hook: the vLLM worker imports verl
(its worker extension class) before it loads the model, and ``linear.py`` looks the function up in the module at
call time.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

VLLM_GEMM_MODULE = "vllm.model_executor.layers.utils"
_MARK = "_claas_keeps_weight"


def keep_cpu_linear_weights(utils_module) -> bool:
    """Wrap ``utils_module.dispatch_cpu_unquantized_gemm`` so that it never removes the layer's weight; True if it
    wrapped (False when already wrapped, or when this vLLM has no such function)."""
    dispatch = getattr(utils_module, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None or getattr(dispatch, _MARK, False):
        return False

    @functools.wraps(dispatch)
    def dispatch_keeping_weight(layer, remove_weight: bool = False):
        return dispatch(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _MARK, True)
    utils_module.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    logger.debug("claas_verl: vLLM CPU linear layers keep their weights (in-place full-weight syncs)")
    return True
