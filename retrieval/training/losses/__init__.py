"""Training losses for retrieval: one loss per file (contrastive, cached contrastive, listwise, pointwise, distillation)."""

from twotower.retrieval.training.losses.distill import listwise_kl
from twotower.retrieval.training.losses.gather import gather_with_grad, rank, world_size
from twotower.retrieval.training.losses.gradcache import RngState, cached_step, split_inputs
from twotower.retrieval.training.losses.infonce import Temperature, info_nce, similarity_matrix
from twotower.retrieval.training.losses.listwise import listwise_ce
from twotower.retrieval.training.losses.pointwise import pointwise_bce

__all__ = [
    "RngState",
    "Temperature",
    "cached_step",
    "gather_with_grad",
    "info_nce",
    "listwise_ce",
    "listwise_kl",
    "pointwise_bce",
    "rank",
    "similarity_matrix",
    "split_inputs",
    "world_size",
]
