"""The decoder and its named scales. The scales table imports nothing heavy; the model (JAX, Flax)
is imported on first use of one of its names, so `diloco sizes --help`, `simulate` and config
validation of a scale name stay light."""
from diloco.model.scales import SCALES, Scale, formula_params
from diloco.model.sizes import param_count

_MODEL_NAMES = ("ATTENTION", "REMAT_POLICIES", "ModelConfig", "Transformer", "loss_fn", "is_qkv_kernel",
                "matrix_view", "param_logical_axes")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from diloco.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'diloco.model' has no attribute {name!r}")


__all__ = ["SCALES", "Scale", "ModelConfig", "Transformer", "loss_fn", "param_count", "formula_params",
           "is_qkv_kernel", "matrix_view", "param_logical_axes", "ATTENTION", "REMAT_POLICIES"]
