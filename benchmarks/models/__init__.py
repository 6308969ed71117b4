"""A model zoo for tests and benchmarks: every model is a `ModelSpec` with a pure train step.

Example:
    >>> import jax
    >>> from benchmarks.models import get_model
    >>> spec = get_model("mlp", "tiny", batch_size=8)
    >>> state = spec.init_state(jax.random.key(0))
    >>> state, metrics = jax.jit(spec.train_step)(state, spec.make_batch(jax.random.key(1)))
    >>> sorted(metrics)
    ['loss']
"""

from __future__ import annotations

from typing import Any

from benchmarks.models import convnet, gpt, llama, mlp, moe, wresnet
from benchmarks.models.common import Batch as Batch
from benchmarks.models.common import ModelSpec as ModelSpec
from benchmarks.models.common import State as State
from benchmarks.models.common import param_count as param_count

_BUILDERS = {
    "mlp": (mlp.build, mlp.CONFIGS, {}),
    "gpt": (gpt.build, gpt.CONFIGS, {}),
    "gpt_scan": (gpt.build, gpt.CONFIGS, {"scan_layers": True}),
    "llama": (llama.build, llama.CONFIGS, {}),
    "llama_scan": (llama.build, llama.CONFIGS, {"scan_layers": True}),
    "convnet": (convnet.build, convnet.CONFIGS, {}),
    "moe": (moe.build, moe.CONFIGS, {}),
    "moe_layer": (moe.build_moe_layer, moe.LAYER_CONFIGS, {}),
    "wresnet": (wresnet.build, wresnet.CONFIGS, {}),
}

# Config names per family; every family has "tiny".
CONFIGS: dict[str, tuple[str, ...]] = {
    family: tuple(configs) for family, (_, configs, _) in _BUILDERS.items()
}


def get_model(family: str, config: str, batch_size: int, **kwargs: Any) -> ModelSpec:
    """Build a model by family and config name, e.g. ``get_model("gpt", "350M", 8)``.

    ``kwargs`` go to the family's builder: ``optimizer``, ``learning_rate``, ``dtype`` for all (llama
    defaults to bf16 compute over fp32 params, the others to fp32); ``attention_impl`` for gpt/moe/llama;
    ``scan_layers`` for gpt/llama; ``remat`` for llama.
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(_BUILDERS)}")
    builder, configs, defaults = _BUILDERS[family]
    if config not in configs:
        raise ValueError(f"unknown {family} config {config!r}; expected one of {sorted(configs)}")
    return builder(config, batch_size, **{**defaults, **kwargs})


__all__ = ["CONFIGS", "Batch", "ModelSpec", "State", "get_model", "param_count"]
