from diloco.model.scales import SCALES, Scale, formula_params, param_count
from diloco.model.transformer import ModelConfig, Transformer, loss_fn

__all__ = ["SCALES", "Scale", "ModelConfig", "Transformer", "loss_fn", "param_count", "formula_params"]
