"""An LSTM sequence-to-sequence model in flax linen.

Encoder and decoder are ``nn.RNN`` over ``nn.OptimizedLSTMCell``; the decoder starts from the
encoder's final carry and is teacher-forced. Dropout on the embeddings draws from a typed key
(``jax.random.key``) that the caller passes into the step, one per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tests.zoo import ADAM_EPS, FunctionalCase


@dataclass(frozen=True)
class Seq2SeqConfig:
    vocab: int = 32
    embed: int = 16
    hidden: int = 32
    src_len: int = 10
    tgt_len: int = 8
    batch: int = 8
    dropout: float = 0.2


class Seq2Seq(nn.Module):
    cfg: Seq2SeqConfig

    @nn.compact
    def __call__(self, src, tgt_in, *, train: bool):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.embed, name="embed")
        drop = nn.Dropout(cfg.dropout, deterministic=not train)
        carry, _ = nn.RNN(nn.OptimizedLSTMCell(cfg.hidden), return_carry=True, name="encoder")(
            drop(embed(src)))
        outputs = nn.RNN(nn.OptimizedLSTMCell(cfg.hidden), name="decoder")(
            drop(embed(tgt_in)), initial_carry=carry)
        return nn.Dense(cfg.vocab, name="project")(outputs)


CFG = Seq2SeqConfig()
# Hidden 1024: for the plan check at wide sizes (tests/test_zoo.py, slow).
WIDE = Seq2SeqConfig(vocab=4096, embed=512, hidden=1024, src_len=16, tgt_len=16, batch=32)


def make_batch(cfg: Seq2SeqConfig = CFG):
    k1, k2 = jax.random.split(jax.random.key(41))
    src = jax.random.randint(k1, (cfg.batch, cfg.src_len), 2, cfg.vocab)
    tgt = jax.random.randint(k2, (cfg.batch, cfg.tgt_len), 2, cfg.vocab)
    tgt_in = jnp.concatenate([jnp.ones((cfg.batch, 1), tgt.dtype), tgt[:, :-1]], axis=1)  # GO token 1
    return {"src": src, "tgt_in": tgt_in, "tgt": tgt}


def dropout_key(step: int):
    """The typed key for step ``step``, as a training loop would fold it in."""
    return jax.random.fold_in(jax.random.key(5), step)


def case(cfg: Seq2SeqConfig = CFG) -> FunctionalCase:
    model, tx = Seq2Seq(cfg), optax.adam(3e-3, eps=ADAM_EPS)

    def init_state():
        batch = make_batch(cfg)
        params = model.init(jax.random.key(0), batch["src"], batch["tgt_in"], train=False)["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def train_step(state, batch, dropout_key):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], train=True,
                                 rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return FunctionalCase("lstm", init_state, lambda: make_batch(cfg), train_step, lambda i: (dropout_key(i),))
