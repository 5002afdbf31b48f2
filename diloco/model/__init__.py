from diloco.model.scales import SCALES, Scale, formula_params, param_count
from diloco.model.transformer import ATTENTION, REMAT_POLICIES, ModelConfig, Transformer, loss_fn, param_logical_axes

__all__ = ["SCALES", "Scale", "ModelConfig", "Transformer", "loss_fn", "param_count", "formula_params",
           "param_logical_axes", "ATTENTION", "REMAT_POLICIES"]
