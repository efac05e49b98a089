"""What only latent attention's families have: a frozen MTP layer in the trainer.  Their models
against transformers, decode and parallel worlds run in the family suite
(``test_family_models.py``, row ``mla``)."""

from __future__ import annotations

import torch

from shardsync.layout import MegatronParallel
from shardsync.models.trainer import TrainerModel
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from tests.dist.test_family_models import inputs
from tests.dist.test_moe_models import SEED, _batch


def test_trainer_holds_the_mtp_layer_frozen() -> None:
    """The MTP layer travels with the model (its megatron-core names, filled from the
    checkpoint) but the RL loss does not train it: an optimizer step leaves it unchanged."""
    spec = PRESETS["tiny-deepseek-v3"]
    model = TrainerModel(spec, MegatronParallel(norm_names="separate"), source=random_source(spec, SEED))
    mtp = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.layers.0.")}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias"} <= set(mtp)
    assert torch.equal(mtp["mtp.layers.0.eh_proj.weight"], random_source(spec, SEED)("model.layers.4.eh_proj.weight"))
    ids, loss_fn = _batch(inputs(spec), 0, 1)
    model.forward_backward(ids, loss_fn)
    model.optimizer_step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in mtp.items())
    assert not torch.equal(after["decoder.layers.1.mlp.router.weight"], random_source(spec, SEED)(
        "model.layers.1.mlp.gate.weight"))  # the model itself trained
