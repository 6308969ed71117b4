"""A diffusion UNet (DDPM) in flax linen, as yiyixuxu/denoising-diffusion-flax writes it.

The model and the step live in ``benchmarks/models/unet.py`` (the planning benchmark plans the same
step): weight-standardised convolutions with GroupNorm, a sinusoidal time embedding, linear attention
at each resolution and full attention in the middle, ``jax.image.resize`` upsampling and skip
concatenations; the step noises the batch at random timesteps of a linear beta schedule and regresses
the noise (l1, the fashion_mnist config's loss). Here: that config (28 x 28 x 1) at dim 16 and
dim_mults (1, 2), batch 8, and a key per step, passed into the step as the repository does.
"""

from __future__ import annotations

import jax
import optax

from benchmarks.models.unet import DDPMConfig, init_state, make_batch, make_train_step
from tests.zoo import ADAM_EPS, FunctionalCase

CFG = DDPMConfig()


def case(cfg: DDPMConfig = CFG) -> FunctionalCase:
    # The config's Adam (b2 0.99), with the zoo's eps (tests/zoo/__init__.py says why).
    model, tx = cfg.build(), optax.adam(1e-3, b1=0.9, b2=0.99, eps=ADAM_EPS)
    return FunctionalCase("unet", lambda: init_state(cfg, model, tx, jax.random.key(0)),
                          lambda: make_batch(cfg, jax.random.key(61)), make_train_step(cfg, model, tx),
                          lambda i: (jax.random.fold_in(jax.random.key(42), i),))
