"""The decoder-only transformer family: configs and analytic sizes (torch-free) and the torch layers.

Importing this package never imports torch: `config` is pure Python so the planner and simulator
can size models. The torch implementation is in `sailor_core.models.torch_model` and
`sailor_core.models.tensor_parallel`; import those explicitly.
"""

from sailor_core.models.config import (
    BUILTIN_CONFIGS,
    TransformerConfig,
    get_config,
    layer_activation_bytes,
    layer_params,
    model_spec,
)

__all__ = [
    "BUILTIN_CONFIGS",
    "TransformerConfig",
    "get_config",
    "layer_activation_bytes",
    "layer_params",
    "model_spec",
]
