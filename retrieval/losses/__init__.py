"""Training losses for retrieval: one loss per file (contrastive, cached contrastive, listwise, pointwise)."""

from retrieval.losses.gather import gather_with_grad, rank, world_size
from retrieval.losses.gradcache import RngState, cached_step, split_inputs
from retrieval.losses.infonce import Temperature, info_nce, similarity_matrix
from retrieval.losses.listwise import listwise_ce
from retrieval.losses.pointwise import pointwise_bce

__all__ = [
    "RngState",
    "Temperature",
    "cached_step",
    "gather_with_grad",
    "info_nce",
    "listwise_ce",
    "pointwise_bce",
    "rank",
    "similarity_matrix",
    "split_inputs",
    "world_size",
]
